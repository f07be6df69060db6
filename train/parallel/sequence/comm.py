"""The only places sequence parallelism talks to other ranks, with a byte counter.

Every all-to-all and ring send goes through these wrappers so a benchmark can read
exactly how many bytes a rank put on the wire (``count_comm_bytes``). Bytes a rank
"sends" to itself in an all-to-all are a local copy and are not counted.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .groups import group_rank, group_size


@dataclass
class CommCounter:
    """Bytes and calls per kind of traffic (``"ulysses"``, ``"ring_kv"``, ...)."""

    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes_sent[kind] += nbytes
        self.calls[kind] += 1

    def total(self, prefix: str = "") -> int:
        return sum(n for kind, n in self.bytes_sent.items() if kind.startswith(prefix))

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.calls.clear()


# Process-wide: counting is a couple of integer adds per message, cheap enough to keep on.
COMM_COUNTER = CommCounter()


@contextmanager
def count_comm_bytes() -> Iterator[CommCounter]:
    """Reset the counter, run the block, and hand back the counter to read."""
    COMM_COUNTER.reset()
    yield COMM_COUNTER


def _row_bytes(t: torch.Tensor) -> int:
    return (t.numel() // max(t.shape[0], 1)) * t.element_size() if t.dim() else t.element_size()


def all_to_all_rows(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: ProcessGroup | None,
    kind: str,
) -> None:
    """``dist.all_to_all_single`` over dim 0 with (possibly uneven) row splits."""
    assert input.is_contiguous() and output.is_contiguous()
    me = group_rank(group)
    rows_to_others = sum(n for peer, n in enumerate(input_split_sizes) if peer != me)
    COMM_COUNTER.add(kind, rows_to_others * _row_bytes(input))
    dist.all_to_all_single(
        output,
        input,
        output_split_sizes=list(output_split_sizes),
        input_split_sizes=list(input_split_sizes),
        group=group,
    )


def all_gather_rows(x: torch.Tensor, group: ProcessGroup | None, *, kind: str) -> list[torch.Tensor]:
    """All-gather equally shaped tensors; returns one tensor per group rank, in rank order."""
    size = group_size(group)
    if size == 1:
        return [x]
    x = x.contiguous()
    COMM_COUNTER.add(kind, (size - 1) * x.numel() * x.element_size())
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return parts


class PendingExchange:
    """Sends/receives posted to ring neighbours; ``wait()`` returns the received tensors."""

    def __init__(self, works: list, received: list[torch.Tensor], keep_alive: list[torch.Tensor]):
        self._works = works
        self._received = received
        self._keep_alive = keep_alive  # a send buffer must live until its send completes

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works = []
        self._keep_alive = []
        return self._received


class RingNeighbours:
    """Global ranks of the next/previous member of a ring group."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(
        self,
        send: Sequence[torch.Tensor],
        recv_like: Sequence[torch.Tensor],
        *,
        kind: str,
        tag: int,
    ) -> PendingExchange:
        """Post "send to next, receive from prev" for each tensor and return immediately.

        Callers post every exchange in the same order on every rank; together with a
        distinct tag per kind of message this keeps same-sized K/V and dK/dV buffers
        from being matched with each other.
        """
        ops, received = [], []
        for i, (out, like) in enumerate(zip(send, recv_like)):
            assert out.is_contiguous()
            buf = torch.empty_like(like)
            COMM_COUNTER.add(kind, out.numel() * out.element_size())
            ops.append(dist.P2POp(dist.isend, out, self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev, self.group, tag + i))
            received.append(buf)
        works = dist.batch_isend_irecv(ops)
        return PendingExchange(works, received, list(send))
