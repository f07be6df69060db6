"""A writer refuses NaN and infinity in float fields by default (a store with one NaN trained a
model into NaN without a word); a field whose values mean them is allowed explicitly."""
import ml_dtypes
import numpy as np
import pytest

from mmcache import featstore

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32, "float64": np.float64}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_is_refused(tmp_path, dtype, bad):
    with featstore.create(str(tmp_path / "s"), fields={"x": dtype, "n": "int32"}) as writer:
        good = np.full((3, 4), 1.5, dtype=DTYPES[dtype])
        writer.add("fine", {"x": good, "n": np.arange(3, dtype=np.int32)})
        poisoned = good.copy()
        poisoned[2, 3] = bad  # one element among many
        with pytest.raises(featstore.NonFiniteError, match="'x' holds NaN or infinity"):
            writer.add("poisoned", {"x": poisoned, "n": np.arange(3, dtype=np.int32)})
    store = featstore.open(str(tmp_path / "s"))
    assert store.sample_ids() == ["fine"]  # nothing of the refused sample was written


def test_largest_finite_values_pass_and_allowed_fields_keep_nan(tmp_path):
    big = {"b": np.full(4, ml_dtypes.finfo(ml_dtypes.bfloat16).max, ml_dtypes.bfloat16), "h": np.full(4, -65504, np.float16)}
    with featstore.create(str(tmp_path / "s"), fields={"b": "bfloat16", "h": "float16", "mask": "float32"},
                          allow_nonfinite=["mask"]) as writer:
        writer.add("edge", {**big, "mask": np.array([0.0, -np.inf, np.nan], np.float32)})
    got = featstore.open(str(tmp_path / "s")).read("edge")
    assert np.isnan(got["mask"][2]) and np.array_equal(got["b"], big["b"])
