"""Sequence-parallel attention primitives (USP = Ulysses all-to-all x ring attention); ``install``
puts them on a model (``apply_sequence_parallel``, not imported here). Tensors are
``[batch, seq, heads, head_dim]`` everywhere in the public API. Typical use::

    groups = sequence_parallel_groups_from_mesh(mesh)            # dims "ring", "ulysses"
    layout = layout_for_groups(seq_len, groups, causal=causal)
    x_local = shard_sequence(x, dim=1, layout=layout)           # pad + slice, no comm
    ...
    out = usp_attention(q, k, v, ulysses_group=groups.ulysses_group,
                        ring_group=groups.ring_group, causal=causal, layout=layout)
"""

from .block_attention import block_attention_backward, block_attention_forward, merge_into
from .comm import COMM_COUNTER, CommCounter, count_comm_bytes
from .groups import (
    SequenceParallelConfigError,
    SequenceParallelGroups,
    check_head_counts,
    check_sequence_parallel_degrees,
    kv_replication_factor,
    sequence_parallel_groups_from_mesh,
    validate_sequence_parallel_mesh,
)
from .document_mask import BLOCK_WORK, BlockWork, DocumentMaskPlan, Tile, count_block_work, visible_pairs
from .kernels import DEVICE_KERNELS, KERNELS, BlockKernel, select_block_kernel
from .ring import ring_attention, zigzag_indices, zigzag_shard, zigzag_unshard
from .ulysses import (
    gather_sequence_mask,
    heads_to_sequence,
    replicate_kv_heads,
    sequence_to_heads,
)
from .usp import (
    SequenceLayout,
    build_document_plan,
    gather_sequence,
    layout_for_groups,
    make_sequence_layout,
    shard_sequence,
    ulysses_attention,
    usp_attention,
)

__all__ = [
    "BLOCK_WORK",
    "BlockKernel",
    "BlockWork",
    "DEVICE_KERNELS",
    "DocumentMaskPlan",
    "KERNELS",
    "Tile",
    "build_document_plan",
    "count_block_work",
    "select_block_kernel",
    "visible_pairs",
    "COMM_COUNTER",
    "CommCounter",
    "SequenceLayout",
    "SequenceParallelConfigError",
    "SequenceParallelGroups",
    "block_attention_backward",
    "block_attention_forward",
    "check_head_counts",
    "check_sequence_parallel_degrees",
    "count_comm_bytes",
    "gather_sequence",
    "gather_sequence_mask",
    "heads_to_sequence",
    "kv_replication_factor",
    "layout_for_groups",
    "make_sequence_layout",
    "merge_into",
    "replicate_kv_heads",
    "ring_attention",
    "sequence_parallel_groups_from_mesh",
    "sequence_to_heads",
    "shard_sequence",
    "ulysses_attention",
    "usp_attention",
    "validate_sequence_parallel_mesh",
    "zigzag_indices",
    "zigzag_shard",
    "zigzag_unshard",
]
