"""Token-cost-balanced batching across data-parallel ranks.

Each sample's cost is ``a·L + b·L²`` (L: its tokens); a global batch is split into near-equal cost
parts (``round_robin``, ``greedy``, ``karmarkar_karp``; deterministic, so every rank agrees), then
``plan_micro_batches`` cuts each rank's part into shape-homogeneous micro-batches, equal in number
on every rank (FSDP's collectives). Design: docs/design/train.md, "Data: token-cost-balanced
batches".
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

from ...featstore.errors import ConfigError


class BalanceError(ValueError):
    """Costs, rank counts or micro-batch limits that cannot be planned."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """cost(L) = linear·L + quadratic·L² in arbitrary units (only ratios matter)."""

    linear: float = 1.0
    quadratic: float = 0.0

    def __post_init__(self) -> None:
        if self.linear < 0 or self.quadratic < 0 or self.linear + self.quadratic == 0:
            raise ConfigError(f"cost model needs non-negative coefficients, not both 0: {self}")

    def __call__(self, tokens: int | float) -> float:
        return self.linear * tokens + self.quadratic * tokens * tokens

    @classmethod
    def for_transformer(cls, dim: int, mlp_ratio: float = 4.0) -> CostModel:
        """FLOP ratio of one DiT block: per token the matmuls cost ~2·(4 + 2 + 2·mlp_ratio)·dim²
        (self-attention projections, cross-attention q/out, MLP) and attention scores plus values
        ~4·L·dim, so b/a = 4 / ((12 + 4·mlp_ratio)·dim)."""
        return cls(linear=1.0, quadratic=4.0 / ((12.0 + 4.0 * mlp_ratio) * dim))


Algorithm = Literal["round_robin", "greedy", "karmarkar_karp"]


def _check(costs: Sequence[float], num_ranks: int) -> list[float]:
    if num_ranks < 1:
        raise BalanceError(f"need at least one rank, got {num_ranks}")
    values = [float(c) for c in costs]
    bad = [i for i, c in enumerate(values) if not (math.isfinite(c) and c >= 0)]
    if bad:
        raise BalanceError(f"costs must be finite and >= 0; sample(s) {bad[:5]} are {[values[i] for i in bad[:5]]}")
    return values


def _heaviest_first(costs: list[float]) -> list[int]:
    return sorted(range(len(costs)), key=lambda i: (-costs[i], i))


def round_robin(costs: Sequence[float], num_ranks: int) -> list[list[int]]:
    values = _check(costs, num_ranks)
    return [list(range(rank, len(values), num_ranks)) for rank in range(num_ranks)]


def greedy(costs: Sequence[float], num_ranks: int) -> list[list[int]]:
    """Longest processing time first, each to the least-loaded rank (ties: fewer samples, then
    lower rank, so zero-cost samples still spread out)."""
    values = _check(costs, num_ranks)
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    _place_longest_first(values, _heaviest_first(values), parts)
    return [sorted(p) for p in parts]


def _place_longest_first(values: list[float], order: list[int], parts: list[list[int]]) -> None:
    """Each sample of ``order`` (heaviest first) to the least-loaded of ``parts`` (ties: fewer
    samples, then lower rank), the parts' loads counted from what they hold already."""
    heap = [(sum(values[i] for i in part), len(part), rank) for rank, part in enumerate(parts)]
    heapq.heapify(heap)
    for index in order:
        load, count, rank = heapq.heappop(heap)
        parts[rank].append(index)
        heapq.heappush(heap, (load + values[index], count + 1, rank))


# Differencing costs what the two partitions merged hold, up to one subset per rank: about
# samples x ranks subset operations once they fill (16,000 samples over 1,000 ranks: ~0.9 s a
# step, measured by benchmarks/balance_bench.py). Past this many, the heaviest samples (at least
# one a rank) are differenced and the rest placed longest-first on the least-loaded rank: with
# many samples a rank, the small ones last, that is as even as differencing them too (same
# benchmark), at O(samples log ranks).
DIFFERENCING_BUDGET = 1_000_000


def karmarkar_karp(costs: Sequence[float], num_ranks: int) -> list[list[int]]:
    """Multiway largest differencing (Karmarkar & Karp 1982; Korf's k-way form).

    Each sample starts as a partial partition of N subsets: itself and N−1 empty ones. The two
    partial partitions with the largest spread (max − min load) are merged by joining the heaviest
    subset of one with the lightest of the other, and so on down; this cancels big differences
    against each other first, which is what beats greedy on long-tailed costs.

    A partition keeps only its non-empty subsets (the empty ones are implied): a merge costs
    what the two hold, not N, so 2,000 samples over 1,000 ranks take milliseconds, not seconds
    and hundreds of MB of empty subsets. Past ``DIFFERENCING_BUDGET``, only the heaviest samples
    are differenced; the rest go longest-first to the least-loaded rank.
    """
    values = _check(costs, num_ranks)
    if not values:
        return [[] for _ in range(num_ranks)]
    order = _heaviest_first(values)
    head = max(num_ranks, DIFFERENCING_BUDGET // num_ranks)
    parts = _differenced(values, order[:head], num_ranks)
    if len(order) > head:
        _place_longest_first(values, order[head:], parts)
        parts = [sorted(p) for p in parts]
    # Rank order: by smallest index (empty parts last), so the plan reads the same everywhere.
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def _differenced(values: list[float], order: list[int], num_ranks: int) -> list[list[int]]:
    """The samples of ``order`` (heaviest first) in ``num_ranks`` parts by largest differencing."""
    # A subset is (-load, -count, its smallest index, indices): tuples that sort heaviest first,
    # ties by more samples, then by smallest index. A partition: its non-empty subsets, sorted.
    heap: list[tuple[float, int, list[tuple[float, int, int, list[int]]]]] = []
    for at, index in enumerate(order):
        heap.append((-values[index], at, [(-values[index], -1, index, [index])]))
    heapq.heapify(heap)
    sequence = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = _merged(first, second, num_ranks)
        lightest = -merged[-1][0] if len(merged) == num_ranks else 0.0
        heapq.heappush(heap, (merged[0][0] + lightest, sequence, merged))
        sequence += 1
    return [sorted(subset[3]) for subset in heap[0][2]] + [[] for _ in range(num_ranks - len(heap[0][2]))]


def _merged(first: list[tuple[float, int, int, list[int]]], second: list[tuple[float, int, int, list[int]]],
            num_ranks: int) -> list[tuple[float, int, int, list[int]]]:
    """Position i of ``first`` (heaviest first, padded with empty subsets to ``num_ranks``) joined
    with position N-1-i of ``second``: only positions where either holds a subset are built."""
    low, high = len(first), num_ranks - len(second)  # first's subsets end at low, second's start at high
    # Positions below high hold first's subsets alone, those from low on second's alone; only the
    # positions between hold both (none when the two fit side by side).
    joined = [(a[0] + b[0], a[1] + b[1], min(a[2], b[2]), a[3] + b[3])
              for a, b in zip(first[high:low], reversed(second[num_ranks - low:]))] if low > high else []
    out = first[:min(high, low)] + joined + second[:num_ranks - max(low, high)]
    out.sort()
    return out


BALANCERS: dict[str, Callable[[Sequence[float], int], list[list[int]]]] = {
    "round_robin": round_robin,
    "greedy": greedy,
    "karmarkar_karp": karmarkar_karp,
}


def balance(costs: Sequence[float], num_ranks: int, algorithm: Algorithm = "karmarkar_karp") -> list[list[int]]:
    try:
        split = BALANCERS[algorithm]
    except KeyError:
        raise ConfigError(f"unknown balance algorithm {algorithm!r}; choose one of {', '.join(BALANCERS)}") from None
    return split(costs, num_ranks)


def part_costs(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> list[float]:
    return [sum(float(costs[i]) for i in part) for part in parts]


def imbalance(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """max / mean of per-rank cost: 1.0 is perfect, 2.0 means the slowest rank does twice its share."""
    loads = part_costs(costs, parts)
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """The ``balance:`` section of a trainer config."""

    algorithm: Algorithm = "karmarkar_karp"
    linear: float = 1.0
    quadratic: float | None = None  # None: from the model width, see CostModel.for_transformer
    max_samples: int | None = None  # per micro-batch
    max_tokens: int | None = None  # per micro-batch (a longer single sample still runs alone)

    def cost_model(self, model_dim: int, mlp_ratio: float = 4.0) -> CostModel:
        if self.quadratic is None:
            derived = CostModel.for_transformer(model_dim, mlp_ratio)
            return CostModel(linear=self.linear, quadratic=derived.quadratic * self.linear)
        return CostModel(linear=self.linear, quadratic=self.quadratic)


def plan_global_batch(
    shapes: Sequence[Hashable], tokens: Sequence[int], num_ranks: int, config: BalanceConfig, cost: CostModel
) -> list[list[MicroBatch]]:
    """Balance a global batch over ``num_ranks`` data-parallel ranks and cut each rank's share
    into equalised, shape-homogeneous micro-batches. Every rank computes the same plan from the
    same batch; rank r trains on ``plan[r]``."""
    if len(shapes) != len(tokens):
        raise BalanceError(f"{len(shapes)} shapes but {len(tokens)} token counts")
    parts = balance([cost(t) for t in tokens], num_ranks, config.algorithm)
    return plan_micro_batches(
        shapes, parts, max_samples=config.max_samples, tokens=tokens, max_tokens=config.max_tokens
    )


# ---- micro-batches ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatch:
    indices: tuple[int, ...]  # positions in the global batch; all samples share ``shape``
    shape: Hashable
    # 0.0 marks a filler: a repeat of one cheap sample run only so that this rank issues as many
    # forward/backward passes (and FSDP collectives) as the others; the trainer multiplies its
    # loss by 0 and leaves it out of the loss count.
    loss_scale: float = 1.0


def plan_micro_batches(
    shapes: Sequence[Hashable],
    parts: Sequence[Sequence[int]],
    *,
    max_samples: int | None = None,
    tokens: Sequence[int] | None = None,
    max_tokens: int | None = None,
    equalize: bool = True,
) -> list[list[MicroBatch]]:
    """Group each rank's samples into micro-batches of one latent shape.

    ``shapes[i]`` is sample i's latent shape (anything hashable); a micro-batch holds at most
    ``max_samples`` samples and at most ``max_tokens`` tokens (``tokens[i]`` per sample; a single
    sample above the limit still forms its own micro-batch). With ``equalize`` every rank gets the
    same number of micro-batches: ranks short of the maximum first split their largest
    micro-batches, then add zero-weight fillers (``loss_scale=0``) of their cheapest sample.
    """
    if max_samples is not None and max_samples < 1:
        raise BalanceError(f"max_samples must be >= 1, got {max_samples}")
    if max_tokens is not None and tokens is None:
        raise BalanceError("max_tokens needs the per-sample tokens")
    tokens = list(tokens) if tokens is not None else [1] * len(shapes)
    if len(tokens) != len(shapes):
        raise BalanceError(f"{len(shapes)} shapes but {len(tokens)} token counts")
    seen = sorted(i for part in parts for i in part)
    if seen != list(range(len(shapes))):
        raise BalanceError("parts must together be a permutation of the batch indices")
    if equalize and any(not part for part in parts):
        raise BalanceError(
            f"a global batch of {len(shapes)} samples leaves a rank of {len(parts)} without any; every "
            "data-parallel rank needs at least one sample per step (raise the global batch size)"
        )
    plan = [_group_rank(part, shapes, tokens, max_samples, max_tokens) for part in parts]
    if equalize:
        target = max(len(rank_plan) for rank_plan in plan)
        plan = [_equalize(rank_plan, target, tokens) for rank_plan in plan]
    return plan


def _group_rank(part, shapes, tokens, max_samples, max_tokens) -> list[MicroBatch]:
    groups: dict[Hashable, list[int]] = {}
    for index in sorted(part):
        groups.setdefault(shapes[index], []).append(index)
    batches: list[MicroBatch] = []
    for shape, members in groups.items():
        current: list[int] = []
        for index in members:
            too_many = max_samples is not None and len(current) >= max_samples
            too_long = max_tokens is not None and sum(tokens[i] for i in current) + tokens[index] > max_tokens
            if current and (too_many or too_long):
                batches.append(MicroBatch(indices=tuple(current), shape=shape))
                current = []
            current.append(index)
        batches.append(MicroBatch(indices=tuple(current), shape=shape))
    # Biggest micro-batches first: the peak-memory step comes early, where it fails fast.
    return sorted(batches, key=lambda b: (-sum(tokens[i] for i in b.indices), b.indices[0]))


def _equalize(batches: list[MicroBatch], target: int, tokens: Sequence[int]) -> list[MicroBatch]:
    batches = list(batches)
    while len(batches) < target:
        largest = max(range(len(batches)), key=lambda j: (len(batches[j].indices), -j))
        if len(batches[largest].indices) < 2:
            break
        mb = batches.pop(largest)
        half = len(mb.indices) // 2
        batches[largest:largest] = [
            MicroBatch(indices=mb.indices[:half], shape=mb.shape),
            MicroBatch(indices=mb.indices[half:], shape=mb.shape),
        ]
    if len(batches) < target:
        cheapest = min((i for b in batches for i in b.indices), key=lambda i: (tokens[i], i))
        shape = next(b.shape for b in batches if cheapest in b.indices)
        filler = MicroBatch(indices=(cheapest,), shape=shape, loss_scale=0.0)
        batches.extend([filler] * (target - len(batches)))
    return batches
