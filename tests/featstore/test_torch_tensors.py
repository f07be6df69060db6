"""torch tensors in and out of the (torch-free) store: bf16 kept exact, no silent casts."""

import numpy as np
import pytest
import torch

from mmcache import featstore
from mmcache.featstore.errors import SchemaError


def _store(tmp_path):
    return featstore.create(str(tmp_path / "store"), {"latent": "bfloat16", "ids": "int32"})


def test_writer_takes_torch_tensors_and_reader_returns_them_bit_exact(tmp_path):
    latent = torch.randn(4, 3, 5, dtype=torch.float32).to(torch.bfloat16).requires_grad_(False)
    ids = torch.arange(7, dtype=torch.int32)
    with _store(tmp_path) as writer:
        writer.add("a", {"latent": latent, "ids": ids})
    store = featstore.open(str(tmp_path / "store"))
    got = store.read("a", format="torch")
    assert got["latent"].dtype == torch.bfloat16 and got["latent"].shape == latent.shape
    assert torch.equal(got["latent"].view(torch.int16), latent.view(torch.int16))
    assert torch.equal(got["ids"], ids)
    as_numpy = store.read("a")  # the default stays numpy (ml_dtypes bfloat16)
    assert as_numpy["latent"].dtype.name == "bfloat16"
    assert np.array_equal(as_numpy["latent"].view(np.int16), latent.view(torch.int16).numpy())


def test_tensor_needing_grad_is_stored_detached(tmp_path):
    latent = torch.ones(2, 2, dtype=torch.bfloat16, requires_grad=True) * 3
    with _store(tmp_path) as writer:
        writer.add("a", {"latent": latent, "ids": torch.zeros(1, dtype=torch.int32)})
    assert torch.equal(featstore.open(str(tmp_path / "store")).read("a", format="torch")["latent"], latent.detach())


def test_wrong_tensor_dtype_is_refused_not_cast(tmp_path):
    with _store(tmp_path) as writer:
        with pytest.raises(SchemaError, match="dtype float32 but the store holds bfloat16"):
            writer.add("a", {"latent": torch.zeros(2, 2), "ids": torch.zeros(1, dtype=torch.int32)})


def test_unknown_format_is_a_clear_error(tmp_path):
    with _store(tmp_path) as writer:
        writer.add("a", {"latent": torch.zeros(1, dtype=torch.bfloat16), "ids": torch.zeros(1, dtype=torch.int32)})
    with pytest.raises(ValueError, match="format must be one of"):
        featstore.open(str(tmp_path / "store")).read("a", format="jax")
