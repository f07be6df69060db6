"""The Euler flow-matching sampler against analytic velocity fields, and guidance 1.0 on a real
(tiny, randomly initialised) DiT."""

from __future__ import annotations

import pytest
import torch

from mmcache.train.models import build_model
from mmcache.train.objective import interpolate, velocity_target
from mmcache.train.sample.sampler import SamplerConfig, SamplerConfigError, euler_sample, initial_noise, sample_one, timestep_grid


def straight_to(target: torch.Tensor):
    """The velocity of the straight path through x_t to ``target`` at t = 0, in the objective's
    convention (x_t = (1 - t) x0 + t eps, v = eps - x0): v = (x_t - x0) / t."""
    def velocity(x, t, text, mask):
        return (x - target) / t.view(-1, *([1] * (x.dim() - 1)))

    return velocity


COND = (torch.zeros(1, 3, 4), torch.ones(1, 3, dtype=torch.bool))
UNCOND = (torch.zeros(1, 1, 4), torch.ones(1, 1, dtype=torch.bool))


@pytest.mark.parametrize("steps,shift", [(1, 1.0), (7, 1.0), (20, 3.0), (5, 0.5)])
def test_lands_on_the_target_of_straight_paths(steps, shift):
    target = torch.randn(2, 4, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    noise = initial_noise((2, 4, 1, 6, 6), seed=3)
    out = euler_sample(straight_to(target), noise, COND, None, SamplerConfig(steps=steps, guidance=1.0, shift=shift))
    assert torch.allclose(out, target, atol=1e-5)
    assert not torch.allclose(noise, target, atol=0.1)


def test_the_objectives_path_is_the_one_sampled():
    """The objective's own target velocity, evaluated on its own path, integrates back to x0."""
    x0, eps = torch.randn(1, 4, 1, 4, 4), initial_noise((1, 4, 1, 4, 4), 0)
    grid = timestep_grid(10).tolist()
    x = interpolate(x0, eps, torch.tensor([grid[0]]))
    assert torch.allclose(x, eps)  # t = 1 is pure noise
    for t, t_next in zip(grid[:-1], grid[1:]):
        x = x + (t_next - t) * velocity_target(x0, eps)
    assert torch.allclose(x, x0, atol=1e-5)


def test_guidance_extrapolates_from_the_empty_prompt():
    a, b = torch.full((1, 2, 1, 2, 2), 1.0), torch.full((1, 2, 1, 2, 2), -1.0)

    def velocity(x, t, text, mask):
        # rows conditioned on the longer text (the prompt) head for a, the empty prompt's for b
        real = mask.sum(1)
        target = torch.where((real == 3).view(-1, 1, 1, 1, 1), a, b)
        return (x - target) / t.view(-1, 1, 1, 1, 1)

    out = euler_sample(velocity, initial_noise(a.shape, 0), COND, UNCOND, SamplerConfig(steps=4, guidance=3.0))
    assert torch.allclose(out, b + 3.0 * (a - b), atol=1e-5)


def test_grid_and_config():
    grid = timestep_grid(4, shift=3.0)
    assert grid[0] == 1 and grid[-1] == 0 and bool((grid[1:] < grid[:-1]).all())
    assert grid[2] > 0.5  # shift > 1 spends more steps at high noise
    with pytest.raises(SamplerConfigError):
        SamplerConfig(steps=0)
    with pytest.raises(SamplerConfigError):
        SamplerConfig(shift=0)
    with pytest.raises(SamplerConfigError, match="empty prompt"):
        euler_sample(straight_to(torch.zeros(1)), torch.zeros(1, 1), COND, None, SamplerConfig(guidance=2.0))


@pytest.fixture(scope="module")
def dit():
    torch.manual_seed(0)
    model = build_model("dit", "tiny", in_channels=4, text_dim=8)
    with torch.no_grad():
        for p in model.parameters():  # adaLN-Zero starts at a zero output: make it say something
            p.normal_(0, 0.2)
    return model.eval()


def test_guidance_one_is_the_conditional_prediction_only(dit):
    text, empty = torch.randn(5, 8), torch.randn(1, 8)
    batches = []
    handle = dit.register_forward_pre_hook(lambda module, args: batches.append(args[0].shape[0]))
    try:
        guided = sample_one(dit, (4, 1, 4, 4), 7, text, empty, SamplerConfig(steps=3, guidance=1.0))
    finally:
        handle.remove()
    assert batches == [1, 1, 1]  # no unconditional half
    # By hand: Euler on the conditional prediction alone.
    x = initial_noise((1, 4, 1, 4, 4), 7)
    grid = timestep_grid(3).tolist()
    with torch.no_grad():
        for t, t_next in zip(grid[:-1], grid[1:]):
            x = x + (t_next - t) * dit(x, torch.full((1,), t), text[None], torch.ones(1, 5, dtype=torch.bool))
    assert torch.equal(guided, x[0])
    assert torch.equal(guided, sample_one(dit, (4, 1, 4, 4), 7, text, None, SamplerConfig(steps=3, guidance=1.0)))
    other = sample_one(dit, (4, 1, 4, 4), 7, text, empty, SamplerConfig(steps=3, guidance=4.0))
    assert not torch.allclose(other, guided)
    assert torch.equal(other, sample_one(dit, (4, 1, 4, 4), 7, text, empty, SamplerConfig(steps=3, guidance=4.0)))  # deterministic


def test_a_batch_of_pairs_matches_each_pair_alone(dit):
    from mmcache.train.sample.sampler import sample_batch

    texts, empty = [torch.randn(5, 8), torch.randn(2, 8)], torch.randn(1, 8)
    config = SamplerConfig(steps=3, guidance=3.0)
    batch = sample_batch(dit, (4, 1, 4, 4), [7, 9], texts, empty, config)
    for row, (text, seed) in zip(batch, zip(texts, [7, 9])):
        assert torch.allclose(row, sample_one(dit, (4, 1, 4, 4), seed, text, empty, config), atol=1e-5)
    assert torch.equal(batch, sample_batch(dit, (4, 1, 4, 4), [7, 9], texts, empty, config))
