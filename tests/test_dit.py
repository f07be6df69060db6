"""The DiT, its registry entry and the flow-matching objective, on CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmcache.featstore.errors import ConfigError
from mmcache.train.models import (
    DiTConfig,
    InputShapeError,
    LatentTextBatch,
    ModelConfigError,
    build_model,
    count_parameters,
    get_model_family,
    pad_text,
)
from mmcache.train.data.balance import BalanceConfig, CostModel, plan_global_batch
from mmcache.train.objective import (
    FlowMatchingConfig,
    draw_timesteps_and_noise,
    flow_matching_loss,
    flow_matching_terms,
    sample_generators,
    sample_timesteps,
)

CHANNELS, TEXT_DIM = 4, 24


def _randomised(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite the adaLN-Zero init: with zero gates the output ignores text and attention."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def _tiny(**overrides) -> torch.nn.Module:
    config = dataclasses.replace(get_model_family("dit").presets["tiny"], **overrides)
    return build_model("dit", config, in_channels=CHANNELS, text_dim=TEXT_DIM)


def _inputs(shape, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(len(lengths), CHANNELS, *shape, generator=gen)
    texts = [torch.randn(n, TEXT_DIM, generator=gen) for n in lengths]
    text, mask = pad_text(texts)
    t = torch.rand(len(lengths), generator=gen)
    return latents, t, text, mask, texts


@pytest.mark.parametrize(
    "thw, patch",
    [((1, 8, 8), (1, 2, 2)), ((1, 6, 10), (1, 2, 2)), ((3, 4, 6), (1, 2, 2)), ((5, 8, 4), (1, 2, 2)), ((4, 4, 4), (2, 2, 2))],
)
def test_output_shape_matches_input_for_images_and_videos(thw, patch):
    model = _randomised(_tiny(patch_t=patch[0], patch_h=patch[1], patch_w=patch[2]))
    latents, t, text, mask, _ = _inputs(thw, [3, 7])
    out = model(latents, t, text, mask)
    assert out.shape == latents.shape
    assert torch.isfinite(out).all()


def test_patchify_roundtrip_and_token_count():
    model = _tiny(patch_t=2)
    latents = torch.randn(2, CHANNELS, 4, 6, 8)
    tokens, grid = model.patchify(latents)
    assert grid == (2, 3, 4) and tokens.shape == (2, 24, CHANNELS * 8)
    assert torch.equal(model.unpatchify(tokens, grid), latents)
    assert model.num_tokens((CHANNELS, 4, 6, 8)) == 24
    with pytest.raises(InputShapeError, match="not divisible by the patch"):
        model.num_tokens((CHANNELS, 1, 6, 8))  # an image with patch_t = 2


def test_padded_text_positions_never_change_the_output():
    model = _randomised(_tiny())
    latents, t, text, mask, texts = _inputs((2, 4, 4), [2, 9, 5])
    reference = model(latents, t, text, mask)
    garbage = text.clone()
    garbage[~mask] = torch.randn(int((~mask).sum()), TEXT_DIM) * 1e3
    garbage[0, -1] = float("nan")  # sample 0 has 2 real tokens, so this is padding
    assert torch.equal(model(latents, t, garbage, mask), reference)
    # Each sample padded in a batch equals that sample alone with its unpadded text.
    for row, real in enumerate(texts):
        alone = model(latents[row : row + 1], t[row : row + 1], real[None], torch.ones(1, len(real), dtype=torch.bool))
        torch.testing.assert_close(alone[0], reference[row], rtol=1e-5, atol=1e-5)
    # ...and the real tokens do matter.
    changed = text.clone()
    changed[1, 0] += 1.0
    assert not torch.allclose(model(latents, t, changed, mask)[1], reference[1])


def test_sample_without_text_is_finite():
    model = _randomised(_tiny())
    latents, t, _, _, _ = _inputs((1, 4, 4), [0, 3])
    text, mask = pad_text([torch.zeros(0, TEXT_DIM), torch.randn(3, TEXT_DIM)])
    assert torch.isfinite(model(latents, t, text, mask)).all()


def test_adaln_zero_init_makes_blocks_identity_and_output_zero():
    model = _tiny(depth=3).eval()
    latents, t, text, mask, _ = _inputs((2, 4, 4), [4, 6])
    tokens, grid = model.patchify(latents)
    x = model.patch_embed(tokens)
    cond = model.time_embed(t)
    context = model.text_embed(text)
    from mmcache.train.models.layers import rope_tables

    cos, sin = rope_tables(grid, model.config.rope_parts, model.config.rope_theta)
    for block in model.blocks:
        assert torch.equal(block(x, cond, context, mask, cos, sin), x)
    assert torch.equal(model(latents, t, text, mask), torch.zeros_like(latents))
    single = build_model("dit", DiTConfig(dim=32, depth=2, heads=2, adaln_single=True), in_channels=CHANNELS, text_dim=TEXT_DIM)
    assert torch.equal(single(latents, t, text, mask), torch.zeros_like(latents))


def test_attention_fn_is_swappable():
    model = _randomised(_tiny())
    latents, t, text, mask, _ = _inputs((2, 4, 4), [3, 3])
    reference = model(latents, t, text, mask)
    calls = []

    def manual_attention(q, k, v):
        calls.append(q.shape)
        weights = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(-1)
        return weights @ v

    model.set_attention_fn(manual_attention)
    torch.testing.assert_close(model(latents, t, text, mask), reference, rtol=1e-4, atol=1e-5)
    assert len(calls) == model.config.depth and calls[0] == (2, model.config.heads, 2 * 2 * 2, model.config.head_dim)
    model.set_attention_fn(F.scaled_dot_product_attention)


def test_rope_distinguishes_positions():
    model = _randomised(_tiny())
    latents, t, text, mask, _ = _inputs((2, 4, 4), [3])
    flipped = latents.flip(-1)  # same token contents, other positions
    assert not torch.allclose(model(flipped, t, text, mask).flip(-1), model(latents, t, text, mask), atol=1e-4)


def test_batch_from_numpy_bf16_samples():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    latents = [np.random.rand(CHANNELS, 1, 4, 4).astype(ml_dtypes.bfloat16) for _ in range(2)]
    texts = [np.random.rand(n, TEXT_DIM).astype(ml_dtypes.bfloat16) for n in (3, 5)]
    batch = LatentTextBatch.from_samples(latents, texts)
    assert batch.latents.dtype == torch.bfloat16 and batch.latents.shape == (2, CHANNELS, 1, 4, 4)
    assert batch.text.shape == (2, 5, TEXT_DIM) and batch.text_mask.sum().item() == 8
    np.testing.assert_array_equal(batch.text[1].float().numpy(), texts[1].astype(np.float32))
    with pytest.raises(InputShapeError, match="one shape"):
        LatentTextBatch.from_samples([latents[0], np.zeros((CHANNELS, 1, 8, 8), np.float32)], texts)


def test_flow_matching_is_deterministic_and_logit_normal():
    config = FlowMatchingConfig(logit_mean=0.0, logit_std=1.0)
    t1 = sample_timesteps(20_000, config, torch.Generator().manual_seed(3))
    t2 = sample_timesteps(20_000, config, torch.Generator().manual_seed(3))
    assert torch.equal(t1, t2) and ((t1 > 0) & (t1 < 1)).all()
    logits = torch.logit(t1.double())
    assert abs(logits.mean().item()) < 0.05 and abs(logits.std().item() - 1) < 0.05
    shifted = sample_timesteps(20_000, FlowMatchingConfig(logit_mean=1.0), torch.Generator().manual_seed(3))
    assert shifted.mean() > t1.mean() + 0.1
    with pytest.raises(ConfigError, match="logit_std"):
        FlowMatchingConfig(logit_std=0.0)


def test_flow_matching_target_and_zero_model_loss():
    # A model that predicts zero has loss E[(eps - x0)^2] exactly, element by element.
    model = _tiny()
    latents, _, text, mask, _ = _inputs((1, 4, 4), [3, 4])
    batch = LatentTextBatch(latents=latents, text=text, text_mask=mask)
    t, noise = torch.full((2,), 0.3), torch.randn_like(latents)
    terms = flow_matching_terms(model, batch, t, noise)
    torch.testing.assert_close(terms.loss_sum, (noise - latents).square().sum())
    assert terms.count == latents.numel() and terms.num_tokens == 2 * 4
    a = flow_matching_loss(model, batch, sample_generators(1, 0, [0, 1]), FlowMatchingConfig())
    b = flow_matching_loss(model, batch, sample_generators(1, 0, [0, 1]), FlowMatchingConfig())
    assert torch.equal(a.loss_sum, b.loss_sum)
    # One generator for the whole micro-batch would tie the draws to the grouping: refused.
    with pytest.raises(ValueError, match="one generator per sample"):
        flow_matching_loss(model, batch, torch.Generator().manual_seed(1), FlowMatchingConfig())
    with pytest.raises(ValueError, match="2 samples, 3 generators"):
        flow_matching_loss(model, batch, sample_generators(1, 0, [0, 1, 2]), FlowMatchingConfig())


def test_per_sample_draws_depend_on_seed_step_and_index_only():
    x0 = torch.zeros(3, CHANNELS, 1, 4, 4)
    t, noise = draw_timesteps_and_noise(x0, FlowMatchingConfig(), sample_generators(0, 5, [10, 11, 12]))
    # Sample 11 drawn alone, or next to other samples, gets the same timestep and noise.
    t_alone, noise_alone = draw_timesteps_and_noise(x0[:1], FlowMatchingConfig(), sample_generators(0, 5, [11]))
    assert torch.equal(t[1:2], t_alone) and torch.equal(noise[1:2], noise_alone)
    # ...and another step, index or seed gives other draws.
    for seed, step, index in ((0, 6, 11), (0, 5, 13), (1, 5, 11)):
        other, _ = draw_timesteps_and_noise(x0[:1], FlowMatchingConfig(), sample_generators(seed, step, [index]))
        assert not torch.equal(other, t_alone)


def test_loss_and_gradients_do_not_depend_on_micro_batch_grouping():
    """The global batch's loss sum and gradient are the same however the balancer splits it over
    ranks and micro-batches (float64, so only summation order differs)."""
    torch.manual_seed(0)
    model = _randomised(_tiny()).train().double()
    shapes = [(CHANNELS, 1, 4, 4)] * 4 + [(CHANNELS, 1, 4, 6)] * 3
    gen = torch.Generator().manual_seed(1)
    latents = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]
    texts = [torch.randn(n, TEXT_DIM, generator=gen, dtype=torch.float64) for n in (3, 7, 1, 5, 2, 6, 4)]
    objective = FlowMatchingConfig()

    def loss_and_grads(ranks: int, config: BalanceConfig) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        total = 0.0
        tokens = [s[2] * s[3] // 4 for s in shapes]
        plan = plan_global_batch(shapes, tokens, ranks, config, CostModel(linear=1.0, quadratic=0.01))
        for rank_plan in plan:
            for mb in rank_plan:
                batch = LatentTextBatch.from_samples([latents[i] for i in mb.indices], [texts[i] for i in mb.indices])
                terms = flow_matching_loss(model, batch, sample_generators(7, 2, mb.indices), objective)
                (terms.loss_sum * mb.loss_scale).backward()
                total += float(terms.loss_sum.detach()) * mb.loss_scale
        return total, [p.grad.clone() for p in model.parameters()]

    reference, reference_grads = loss_and_grads(1, BalanceConfig())
    for ranks, config in [(1, BalanceConfig(max_samples=1)), (2, BalanceConfig()), (3, BalanceConfig(algorithm="greedy")),
                          (2, BalanceConfig(max_samples=2)), (4, BalanceConfig(algorithm="round_robin"))]:
        total, grads = loss_and_grads(ranks, config)
        assert total == pytest.approx(reference, rel=1e-12), (ranks, config)
        for got, expected in zip(grads, reference_grads, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_a_few_adam_steps_lower_the_flow_matching_loss():
    torch.manual_seed(0)
    family = get_model_family("dit")
    model = build_model("dit", "tiny", in_channels=CHANNELS, text_dim=TEXT_DIM)
    objective = family.resolve_objective({"logit_mean": 0.0, "logit_std": 1.0})
    gen = torch.Generator().manual_seed(0)
    # Structured data the model can learn: latents are a function of the caption.
    texts = [torch.randn(5, TEXT_DIM, generator=gen) for _ in range(8)]
    latents = torch.stack([t.mean(0)[:CHANNELS, None, None, None].expand(CHANNELS, 1, 8, 8) for t in texts])
    latents = latents + 0.1 * torch.randn(latents.shape, generator=gen)
    batch = LatentTextBatch.from_samples(list(latents), texts)
    fixed_t, fixed_noise = torch.rand(8, generator=gen), torch.randn(latents.shape, generator=gen)

    def evaluate() -> float:
        with torch.no_grad():
            return flow_matching_terms(model, batch, fixed_t, fixed_noise).mean().item()

    before = evaluate()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(30):
        terms = family.training_loss(model, batch, sample_generators(0, step, range(8)), objective)
        optimizer.zero_grad()
        (terms.loss_sum / terms.count).backward()
        optimizer.step()
    after = evaluate()
    assert after < 0.7 * before, (before, after)


def test_registry_errors_and_config_validation():
    with pytest.raises(ModelConfigError, match="unknown model 'nope'; known models: dit"):
        build_model("nope", None, in_channels=4, text_dim=8)
    with pytest.raises(ModelConfigError, match="missing: text_dim"):
        build_model("dit", "tiny", in_channels=4)
    with pytest.raises(ModelConfigError, match="no preset"):
        build_model("dit", "huge", in_channels=4, text_dim=8)
    with pytest.raises(ConfigError, match="unknown key"):
        build_model("dit", {"dimm": 64}, in_channels=4, text_dim=8)
    with pytest.raises(ModelConfigError, match="divisible by model.heads"):
        DiTConfig(dim=30, heads=4)
    with pytest.raises(ModelConfigError, match="rope_split"):
        DiTConfig(dim=64, heads=4, rope_split=(4, 4, 4))
    model = build_model("dit", {"dim": 32, "heads": 2, "depth": 1, "rope_split": [4, 6, 6]}, in_channels=4, text_dim=8)
    assert model.config.rope_parts == (4, 6, 6)
    with pytest.raises(InputShapeError, match="latents must be"):
        model(torch.zeros(1, 3, 1, 4, 4), torch.zeros(1), torch.zeros(1, 2, 8), torch.ones(1, 2, dtype=torch.bool))


def test_presets_sizes_on_meta_device():
    tiny = count_parameters("dit", "tiny", in_channels=CHANNELS, text_dim=TEXT_DIM)
    assert 100_000 <= tiny <= 1_000_000
    # Open-Sora-Plan scale (WF-VAE 8 latent channels, mT5-XXL 4096-wide text): built on meta only.
    big = count_parameters("dit", "osp", in_channels=8, text_dim=4096)
    assert 2.5e9 < big < 3.0e9, big
    with torch.device("meta"):
        model = build_model("dit", "osp", in_channels=8, text_dim=4096)
    assert all(p.is_meta for p in model.parameters())


def test_the_preset_grows_to_hold_one_patch_token_and_a_set_width_must():
    family = get_model_family("dit")
    tiny = family.presets["tiny"]
    # 32 channels (TAESD-F2) x 2x2 patch = 128 values per token against the tiny width of 64
    assert family.fit_inputs(tiny, set(), in_channels=32, text_dim=TEXT_DIM) == {"dim": 128}
    assert family.fit_inputs(tiny, set(), in_channels=3, text_dim=TEXT_DIM) == {}  # 12 values fit in 64
    assert family.fit_inputs(tiny, set(), in_channels=17, text_dim=TEXT_DIM) == {"dim": 72}  # 68, to a multiple of 2 x heads
    with pytest.raises(ModelConfigError, match=r"model.args.dim \(64\) is narrower .* set model.args.dim >= 128"):
        family.fit_inputs(tiny, {"dim"}, in_channels=32, text_dim=TEXT_DIM)
    assert family.fit_inputs(dataclasses.replace(tiny, dim=128), {"dim"}, in_channels=32, text_dim=TEXT_DIM) == {}
