"""How a model is laid out over ranks, applied by ``parallelize`` in one fixed order.

    dims                      ParallelDims: replicate x shard x (ulysses x ring), the meshes and the backend
    sequence/                 USP: Ulysses all-to-all, ring attention, causal layouts, kernels, and
                              install (apply_sequence_parallel: USP on a model's attention)
    encoders                  apply_encoder_sequence_parallel: live and trained encoders under SP
    fsdp                      apply_fsdp: ZeRO-2/3 and HSDP with FSDP2 fully_shard
    parallelize               the order: sequence parallelism, then FSDP (why: docs/design/train.md)
"""
