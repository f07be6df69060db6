"""Live and trained encoders under sequence parallelism (``mmcache.train.parallel.encoders``): the ranks of
an SP group, which train on the same samples, each encode only their share of them and gather the
rest. Real gloo ranks (the fork-server harness) on the real tiny store of the joint-finetune
tests: 1 DP × 2 Ulysses and 1 DP × 2 ring give the losses and trained-encoder weights of one
process, each rank encoding a part of the batch; and the gathers themselves, exactly, with the
gradient of a loss each rank holds only a part of."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook

from mmcache.featstore.config import load_config
from tests.joint_store import dataset, encode, losses, records
from tests.ranks import run_on_ranks

STEPS = 5
PARITY = ["optim.grad_clip=0"]  # clipping is exact too, but its norm adds rounding across ranks
LIVE = ["encoders.latent.mode=live", "encoders.text_emb.mode=live"]
# 3 of the 10 samples held out, a batch of 4 of the 7 left: val_loss (step 3 and the end) runs the
# trained encoder on batches of one sample, so the second rank of a pair has none of its own.
TRAIN = ["encoders.text_emb.mode=train", "encoders.text_emb.lr_scale=2", "data.validation_fraction=0.3", "data.global_batch=4",
         "sample.every=3"]
SP = {"ulysses": ["parallel.ulysses=2"], "ring": ["parallel.ring=2"]}
DP: dict[str, list[str]] = {"dp": []}  # 2 data-parallel ranks: each encodes its own samples anyway


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("jointsp")
    return encode(dataset(root / "data", images=8, videos=2), root / "store")


def _fit(store: str, out: str, sets: list[str], rank: int, world: int, preset: str = "tiny-dit") -> dict:
    from mmcache.train.config import TrainConfig
    from mmcache.train.trainer import fit

    config = load_config(TrainConfig, preset, "train", sets)
    checked, gathered = Counter[str](), set()

    def sharded_before_training_forward(module: torch.nn.Module, _args) -> None:
        # What an evaluation (no-grad forwards) leaves behind, seen at the next training forward,
        # before FSDP gathers anything for it: fit's reshard after val_loss leaves every parameter
        # sharded (a DTensor); without it FSDP keeps the root's and last block's gathered tensors
        # registered until the next backward.
        if isinstance(module, FSDPModule) and torch.is_grad_enabled():
            checked[type(module).__name__] += 1
            gathered.update(f"{type(module).__name__}.{n}" for n, p in module.named_parameters() if not isinstance(p, DTensor))

    hook = register_module_forward_pre_hook(sharded_before_training_forward)
    try:
        result = fit(config, store, out, steps=STEPS, log=lambda *_: None)
    finally:
        hook.remove()
    return {"encoded": result["encoded"], "idle": result["idle_encoder_runs"], "checked": dict(checked), "gathered": sorted(gathered)}


def fit_on(store: str, out: Path, world: int, *sets: str) -> list[dict]:
    return run_on_ranks(functools.partial(_fit, store, str(out), list(sets)), world)


@pytest.fixture(scope="module")
def one_rank(store, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("one")
    return {mode: (root / mode, fit_on(store, root / mode, 1, *PARITY, *sets)[0]) for mode, sets in (("live", LIVE), ("train", TRAIN))}


@pytest.mark.parametrize("sp", sorted(SP))
def test_live_fields_encode_a_share_per_sequence_parallel_rank(store, one_rank, tmp_path, sp):
    run, alone = one_rank["live"]
    ranks = fit_on(store, tmp_path / "sp", 2, *PARITY, *LIVE, *SP[sp])
    assert losses(tmp_path / "sp") == pytest.approx(losses(run), rel=1e-5)
    assert alone["encoded"] == {"latent": 8 * STEPS, "text_emb": 8 * STEPS}
    for name, total in alone["encoded"].items():
        shares = [r["encoded"][name] for r in ranks]
        # Each sample encoded once in the group; the latents split by size (the videos' are 5x an image's).
        assert sum(shares) == total and max(shares) < total and min(shares) > 0, (name, shares)


@pytest.mark.parametrize("sp", sorted(SP) + sorted(DP))
def test_trained_encoder_encodes_a_share_per_sequence_parallel_rank(store, one_rank, tmp_path, sp):
    """Also at 2 DP ranks: the step after a val_loss (whose no-grad forward leaves FSDP's root and
    last block gathered) once normalised and clipped the encoder's gradients through a parameter
    list taken before it, when FSDP had the gathered parameters registered: those units' gradients
    reached the optimizer count times too large, at any world size > 1."""
    from safetensors.torch import load_file

    run, alone = one_rank["train"]
    ranks = fit_on(store, tmp_path / "sp", 2, *PARITY, *TRAIN, *{**SP, **DP}[sp])
    ones, twos = records(run), records(tmp_path / "sp")
    assert [r["loss"] for r in twos] == pytest.approx([r["loss"] for r in ones], rel=1e-5)
    val = [r["val_loss"] for r in twos if "val_loss" in r]
    assert len(val) == 2 and val == pytest.approx([r["val_loss"] for r in ones if "val_loss" in r], rel=1e-5)
    norms = [r["grad_norm.encoder.text_emb"] for r in twos]
    # (Gradients summed over 2 ranks round otherwise; Adam's first, sign-like steps make that ~1e-5 of the norm.)
    assert min(norms[2:]) > 0 and norms == pytest.approx([r["grad_norm.encoder.text_emb"] for r in ones], rel=1e-4)
    one, two = (load_file(path / "export" / "text_emb" / "model.safetensors") for path in (run, tmp_path / "sp"))
    drift = {k: float(np.linalg.norm(one[k].numpy() - two[k].numpy()) / max(np.linalg.norm(one[k].numpy()), 1e-12)) for k in one}
    # Those rounding differences again, through 3 Adam steps: 2e-7 to 3e-6 seen (the bug above: 1e-4 of the loss).
    assert max(drift.values()) < 1e-4, sorted(drift.items(), key=lambda kv: -kv[1])[:3]
    # 4 training samples a step, and 3 held-out ones at each of the 2 evaluations.
    assert alone["encoded"] == {"text_emb": 4 * STEPS + 3 * 2} and alone["idle"] == {}
    # After the evaluation at step 3, steps 4 and 5 start from sharded parameters, the model's and the encoder's.
    for r in ranks:
        assert r["gathered"] == [] and {"FSDPDiT", "FSDPT5EncoderModel"} <= set(r["checked"]), r
    shares = [r["encoded"]["text_emb"] for r in ranks]
    if sp in DP:  # each rank its own part of the batches (with the balancer's filler micro-batches)
        assert max(shares) < alone["encoded"]["text_emb"] and ranks[0]["idle"] == ranks[1]["idle"] == {}, shares
        return
    assert sum(shares) == alone["encoded"]["text_emb"] and max(shares) < sum(shares), shares
    # A rank with no sample of its own in a batch (the one-sample validation batches at least)
    # still runs the encoder once, for FSDP's collectives; its gather adds nothing of it.
    assert ranks[1]["idle"]["text_emb"] >= 2 * 3 and "text_emb" not in ranks[0]["idle"]


@pytest.fixture(scope="module")
def vlm_store(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("vlmsp")
    return encode(dataset(root / "data", images=8, videos=0), root / "store", preset="tiny-vlm")


def test_trained_vit_of_the_vlm_encodes_a_share_per_sequence_parallel_rank(vlm_store, tmp_path):
    """The VLM's causal packed layout: the ViT's features enter the embeddings before sharding."""
    sets = [*PARITY, "encoders.vit_features.mode=train", "encoders.vit_features.last_blocks=1"]
    alone = run_on_ranks(functools.partial(_fit, vlm_store, str(tmp_path / "one"), sets, preset="tiny-vlm"), 1)[0]
    ranks = run_on_ranks(functools.partial(_fit, vlm_store, str(tmp_path / "two"), [*sets, *SP["ulysses"]], preset="tiny-vlm"), 2)
    ones, twos = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["loss"] for r in twos] == pytest.approx([r["loss"] for r in ones], rel=1e-5)
    assert min(r["grad_norm.encoder.vit_features"] for r in twos) > 0
    assert [r["grad_norm.encoder.vit_features"] for r in twos] == pytest.approx([r["grad_norm.encoder.vit_features"] for r in ones], rel=1e-4)
    assert alone["encoded"] == {"vit_features": 8 * STEPS}
    assert [r["encoded"]["vit_features"] for r in ranks] == [4 * STEPS, 4 * STEPS]  # 8 equal images a step


# -- the gathers themselves ------------------------------------------------------------------------
def _gather_cases(rank: int, world: int) -> dict:
    from mmcache.train.parallel.encoders import EncoderShareError, SampleSplit

    group = dist.new_group(list(range(world)))
    split = SampleSplit(group, group)
    torch.manual_seed(0)  # the same encoder, inputs and loss weights on every rank
    encoder = torch.nn.Linear(3, 2)
    inputs = [torch.randn(n, 3) for n in (5, 1, 3, 2, 4)]
    weights = [torch.randn(n, 2) for n in (5, 1, 3, 2, 4)]

    def share_of_loss(features: list[torch.Tensor], batch: list[int], which: int) -> torch.Tensor:
        # Like an SP rank's loss: only some rows (its tokens) of each sample's features reach it.
        return sum(((f * weights[k])[which::world]).sum() for f, k in zip(features, batch, strict=True))

    def reference(batch: list[int]) -> torch.Tensor:
        encoder.zero_grad()
        sum(share_of_loss([encoder(inputs[k]) for k in batch], batch, r) for r in range(world)).backward()
        return encoder.weight.grad.clone()

    out: dict = {}
    for label, batch in (("ragged", [0, 1, 2, 3, 4]), ("one sample", [2])):
        want = reference(batch)
        encoder.zero_grad()
        owners = split.owners([inputs[k].numel() for k in batch])
        mine = split.mine(owners)
        if mine:
            features = split.gather_features([encoder(inputs[batch[i]]) for i in mine], owners)
        else:
            features = split.gather_features([], owners, idle=encoder(inputs[batch[0]]))
        for k, f in zip(batch, features, strict=True):
            assert torch.equal(f, encoder(inputs[k])), label  # bit for bit what the owner computed
        share_of_loss(features, batch, rank).backward()
        grad = encoder.weight.grad.clone()
        dist.all_reduce(grad, group=group)  # what FSDP's summed reduce-scatter makes of the ranks' gradients
        torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-7)
        out[label] = {"mine": mine, "grad_is_set": encoder.weight.grad is not None}

    # The pipeline's numpy arrays: ragged bfloat16, exact.
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((n, 4)).astype(ml_dtypes.bfloat16) for n in (3, 7, 2)]
    owners = split.owners([a.size for a in arrays])
    got = split.gather_arrays([arrays[k] for k in split.mine(owners)], owners, np.dtype(ml_dtypes.bfloat16), "encoders.x")
    assert [g.tobytes() for g in got] == [a.tobytes() for a in arrays] and [g.shape for g in got] == [a.shape for a in arrays]
    # A rank whose share failed raises its own error; the others, after hearing of it, say whose.
    try:
        split.agree([("x", owners)], ValueError("sample 'b': media moved") if rank == 1 else None, "encoders")
    except (ValueError, EncoderShareError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    # Ranks that split the samples differently raise, both, instead of mixing each other's shares:
    # before a batch's gathers (agree), and in a gather's own header (the step's trained features).
    swapped = [1 - o for o in owners] if rank == 1 else owners
    for label, call in (("plans", lambda: split.agree([("x", swapped)], None, "encoders")),
                        ("split", lambda: split.gather_arrays([arrays[k] for k in split.mine(swapped)], swapped,
                                                              np.dtype(ml_dtypes.bfloat16), "encoders.x"))):
        with pytest.raises(EncoderShareError) as caught:
            call()
        out[label] = str(caught.value)
    return out


def test_gathers_are_exact_and_their_backward_sums_each_samples_gradient():
    ranks = run_on_ranks(_gather_cases, 2)
    # Balanced by size, heaviest first: 15 + 6 + 3 values on one rank, 12 + 9 on the other.
    assert [r["ragged"]["mine"] for r in ranks] == [[0, 1, 3], [2, 4]]
    assert [r["one sample"]["mine"] for r in ranks] == [[0], []]
    assert ranks[1]["one sample"]["grad_is_set"]  # the idle run took part in the backward
    assert ranks[0]["error"] == ("EncoderShareError: encoders: rank 1 of this sequence-parallel group could not prepare its share "
                                 "of the batch (its own error says why)")
    assert ranks[1]["error"] == "ValueError: sample 'b': media moved"
    for rank, other in ((0, 1), (1, 0)):
        assert f"this rank ({rank}) planned 1 gather(s)" in ranks[rank]["plans"] and f"and rank {other} of" in ranks[rank]["plans"]
        assert f"this rank ({rank}) split 3 samples" in ranks[rank]["split"] and f"and rank {other} of" in ranks[rank]["split"]


def _failing_preparation(store: str, rank: int, world: int) -> str:
    from mmcache import featstore
    from mmcache.train.config import TrainConfig
    from mmcache.train.live.fields import LiveFields
    from mmcache.train.parallel.dims import ParallelDims
    from mmcache.train.parallel.encoders import apply_encoder_sequence_parallel

    # The latent trained: its inputs (decoded pixels) are prepared in complete, before the live
    # captions' share is encoded; rank 1 finds no media where the config says (a missing mount).
    sets = ["encoders.latent.mode=train", "encoders.text_emb.mode=live", *(["data.media_root=/nonexistent"] if rank == 1 else [])]
    opened = featstore.open(store)
    live = LiveFields.build(load_config(TrainConfig, "tiny-dit", "train", sets), opened, ["latent", "text_emb"])
    apply_encoder_sequence_parallel(live, ParallelDims(ulysses=2, world_size=world).build_meshes("cpu"))
    ids = opened.sample_ids()[:4]
    pending = live.complete([{} for _ in ids], ids)
    try:
        live.gather(pending)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(exc).__name__}: {exc}"
    return "gathered"


def test_a_rank_failing_to_prepare_its_inputs_makes_every_rank_raise(store):
    """Once, the other rank waited in the live captions' gather for the failed rank's share until
    the process group's timeout; a short deadline makes that a failure here, not a hang."""
    other, failed = run_on_ranks(functools.partial(_failing_preparation, store), 2, deadline_s=45)
    assert other == ("EncoderShareError: encoders: rank 1 of this sequence-parallel group could not prepare its share of the "
                     "batch (its own error says why)")
    assert "/nonexistent" in failed and not failed.startswith("EncoderShareError"), failed


def _two_groups_case(rank: int, world: int) -> list:
    from types import SimpleNamespace

    from mmcache.train.parallel.dims import ParallelDims
    from mmcache.train.parallel.encoders import apply_encoder_sequence_parallel

    meshes = ParallelDims(dp_shard=2, ulysses=2, world_size=world).build_meshes("cpu")
    live = apply_encoder_sequence_parallel(SimpleNamespace(split=None), meshes)
    split = live.split
    assert (split.rank, split.size) == (rank % 2, 2)
    got = split.gather_arrays([np.array([rank, 10 * rank], dtype=np.int64)], [0, 1], np.dtype(np.int64), "encoders.x")
    return [g.tolist() for g in got]


def test_each_sequence_parallel_group_gathers_within_itself():
    """2 DP × 2 Ulysses: ranks 0-1 and 2-3 are the SP groups (the world mesh's innermost dims)."""
    assert run_on_ranks(_two_groups_case, 4) == [[[0, 0], [1, 10]]] * 2 + [[[2, 20], [3, 30]]] * 2
