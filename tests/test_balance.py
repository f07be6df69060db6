"""Token-cost balancing across data-parallel ranks and shape-homogeneous micro-batches."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from mmcache.featstore.errors import ConfigError
from mmcache.train.data.balance import (
    BALANCERS,
    BalanceConfig,
    BalanceError,
    CostModel,
    balance,
    greedy,
    imbalance,
    karmarkar_karp,
    part_costs,
    plan_global_batch,
    plan_micro_batches,
    round_robin,
)

ALGORITHMS = sorted(BALANCERS)


def _long_tailed_costs(seed: int, n: int = 64) -> list[float]:
    """Lognormal token counts (median 256, σ 0.75) clipped to a resolution range, DiT-like cost."""
    rng = np.random.default_rng(seed)
    tokens = np.clip(np.round(rng.lognormal(np.log(256), 0.75, size=n)), 16, 1024).astype(int)
    cost = CostModel.for_transformer(64)
    return [cost(int(t)) for t in tokens]


def _assert_permutation(parts, n, num_ranks):
    assert len(parts) == num_ranks
    assert sorted(i for p in parts for i in p) == list(range(n))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n, ranks", [(0, 3), (1, 4), (5, 5), (17, 4), (64, 8), (3, 1)])
def test_every_algorithm_returns_a_permutation(algorithm, n, ranks):
    costs = [random.Random(n).uniform(0, 10) for _ in range(n)]
    parts = balance(costs, ranks, algorithm)
    _assert_permutation(parts, n, ranks)
    if n >= ranks:  # nobody idles when there is enough work
        assert all(parts)


@pytest.mark.parametrize("seed", range(6))
def test_long_tailed_batch_is_balanced_by_greedy_and_kk(seed):
    costs = _long_tailed_costs(seed)
    rr = imbalance(costs, round_robin(costs, 4))
    lpt = imbalance(costs, greedy(costs, 4))
    kk = imbalance(costs, karmarkar_karp(costs, 4))
    assert lpt <= 1.06 and kk <= 1.06, (lpt, kk)
    assert rr >= 1.1 and rr - max(lpt, kk) >= 0.1, (rr, lpt, kk)


def test_kk_beats_greedy_on_the_textbook_case():
    # {8, 7, 6, 5, 4} into 2: LPT ends 17 | 13; differencing (8-7, 6-5, then 4-1-1) ends 16 | 14.
    costs = [8, 7, 6, 5, 4]
    assert sorted(part_costs(costs, greedy(costs, 2))) == [13, 17]
    assert sorted(part_costs(costs, karmarkar_karp(costs, 2))) == [14, 16]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_deterministic_and_ties_broken_by_index(algorithm):
    costs = _long_tailed_costs(7, n=40)
    assert balance(costs, 4, algorithm) == balance(list(costs), 4, algorithm)
    equal = [1.0] * 8
    parts = balance(equal, 4, algorithm)
    assert parts == balance(equal, 4, algorithm)
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    zeros = balance([0.0] * 6, 3, algorithm)
    assert all(len(p) == 2 for p in zeros)


def test_imbalance_and_errors():
    assert imbalance([1, 1, 2], [[0, 1], [2]]) == 1.0
    assert imbalance([3, 1], [[0], [1]]) == pytest.approx(1.5)
    with pytest.raises(BalanceError, match="at least one rank"):
        greedy([1.0], 0)
    with pytest.raises(BalanceError, match="finite and >= 0"):
        karmarkar_karp([1.0, float("nan")], 2)
    with pytest.raises(ConfigError, match="unknown balance algorithm"):
        balance([1.0], 1, "magic")
    with pytest.raises(ConfigError):
        CostModel(linear=0, quadratic=0)
    assert CostModel(linear=2, quadratic=0.5)(4) == 16


def _variable_batch(seed: int, n: int = 48):
    rng = random.Random(seed)
    buckets = [(16, 1, 32, 32), (16, 1, 48, 32), (16, 5, 32, 32), (16, 9, 24, 40), (16, 17, 16, 16)]
    shapes = [rng.choice(buckets) for _ in range(n)]
    tokens = [s[1] * (s[2] // 2) * (s[3] // 2) for s in shapes]
    return shapes, tokens


@pytest.mark.parametrize("equalize", [True, False])
def test_micro_batches_are_shape_homogeneous_and_cover_the_batch(equalize):
    shapes, tokens = _variable_batch(0)
    costs = [CostModel.for_transformer(64)(t) for t in tokens]
    parts = karmarkar_karp(costs, 4)
    plan = plan_micro_batches(shapes, parts, max_samples=4, tokens=tokens, max_tokens=2048, equalize=equalize)
    for part, rank_plan in zip(parts, plan):
        real = [i for mb in rank_plan if mb.loss_scale == 1.0 for i in mb.indices]
        assert sorted(real) == sorted(part)  # each sample exactly once, on its own rank
        for mb in rank_plan:
            assert {shapes[i] for i in mb.indices} == {mb.shape}
            assert len(mb.indices) <= 4
            assert len(mb.indices) == 1 or sum(tokens[i] for i in mb.indices) <= 2048
    if equalize:
        assert len({len(rank_plan) for rank_plan in plan}) == 1


def test_equalize_splits_before_adding_fillers():
    shapes = [(1,)] * 4 + [(2,), (3,), (4,), (5,)]
    tokens = [10, 10, 10, 10, 50, 60, 70, 80]
    plan = plan_micro_batches(shapes, [[0, 1, 2, 3], [4, 5, 6, 7]], tokens=tokens)
    assert [len(rank_plan) for rank_plan in plan] == [4, 4]
    assert all(mb.loss_scale == 1.0 for mb in plan[0])  # split into 4 singles, no filler needed
    plan = plan_micro_batches([(1,), (2,), (3,), (4,)], [[0], [1, 2, 3]], tokens=[5, 1, 1, 1])
    fillers = [mb for mb in plan[0] if mb.loss_scale == 0.0]
    assert len(plan[0]) == 3 and len(fillers) == 2 and fillers[0].indices == (0,)


def test_micro_batch_plan_errors():
    with pytest.raises(BalanceError, match="without any"):
        plan_micro_batches([(1,)] * 3, [[0], [1, 2], []])
    with pytest.raises(BalanceError, match="permutation"):
        plan_micro_batches([(1,)] * 3, [[0], [1, 1]])
    with pytest.raises(BalanceError, match="max_tokens needs"):
        plan_micro_batches([(1,)], [[0]], max_tokens=10)


def test_plan_global_batch_from_a_yaml_config():
    from mmcache.featstore.config import from_dict

    config = from_dict(BalanceConfig, {"algorithm": "greedy", "max_samples": 3}, where="balance")
    cost = config.cost_model(model_dim=64)
    assert cost.quadratic == pytest.approx(CostModel.for_transformer(64).quadratic)
    shapes, tokens = _variable_batch(3, n=32)
    plan = plan_global_batch(shapes, tokens, 4, config, cost)
    assert len({len(rank_plan) for rank_plan in plan}) == 1
    real = sorted(i for rank_plan in plan for mb in rank_plan if mb.loss_scale for i in mb.indices)
    assert real == list(range(32))
    assert plan == plan_global_batch(shapes, tokens, 4, config, cost)
    with pytest.raises(ConfigError, match="not one of"):
        from_dict(BalanceConfig, {"algorithm": "lpt"})


def _textbook_karmarkar_karp(costs: list[float], num_ranks: int) -> list[list[int]]:
    """The multiway differencing method as written down: every partition holds all N subsets."""
    heap = []
    for order, index in enumerate(sorted(range(len(costs)), key=lambda i: (-costs[i], i))):
        heap.append((-costs[index], order, [(costs[index], 1, [index])] + [(0.0, 0, [])] * (num_ranks - 1)))
    heapq.heapify(heap)
    sequence = len(heap)
    while len(heap) > 1:
        first, second = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        merged = sorted(((a[0] + b[0], a[1] + b[1], a[2] + b[2]) for a, b in zip(first, reversed(second))),
                        key=lambda s: (-s[0], -s[1], min(s[2], default=-1)))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), sequence, merged))
        sequence += 1
    return sorted((sorted(s[2]) for s in heap[0][2]), key=lambda p: (not p, p[0] if p else 0))


def test_karmarkar_karp_keeps_only_non_empty_subsets_and_splits_as_the_textbook_method():
    rng = random.Random(3)
    for _ in range(150):
        num_ranks = rng.randint(1, 40)
        costs = [rng.choice([0.0, 1.0, 2.0, rng.random() * 10, rng.paretovariate(1.2)]) for _ in range(rng.randint(0, 120))]
        assert karmarkar_karp(costs, num_ranks) == _textbook_karmarkar_karp(costs, num_ranks)
    # A global batch of 2,000 over 1,000 ranks (benchmarks/train_plan_bench.py times it).
    costs = [rng.paretovariate(1.5) for _ in range(2000)]
    parts = karmarkar_karp(costs, 1000)
    assert sorted(i for part in parts for i in part) == list(range(2000))
    assert imbalance(costs, parts) <= imbalance(costs, greedy(costs, 1000))


def test_past_the_differencing_budget_the_plan_is_as_even_and_still_a_partition():
    """200 samples a rank over 100 ranks: past DIFFERENCING_BUDGET the heaviest samples are
    differenced and the rest placed longest-first; every sample is placed once, the same on
    every call, and the loads at least as even as greedy's alone."""
    from mmcache.train.data.balance import DIFFERENCING_BUDGET

    ranks = 100
    rng = random.Random(3)
    costs = [rng.lognormvariate(0, 0.5) for _ in range(200 * ranks)]
    assert len(costs) > DIFFERENCING_BUDGET // ranks  # the case past the budget
    parts = karmarkar_karp(costs, ranks)
    assert sorted(i for p in parts for i in p) == list(range(len(costs))) and parts == karmarkar_karp(costs, ranks)
    spread = [max(loads) - min(loads) for loads in ([sum(costs[i] for i in p) for p in plan] for plan in (parts, greedy(costs, ranks)))]
    assert spread[0] <= spread[1] and spread[0] < min(costs), spread  # no rank off by as much as the smallest sample
