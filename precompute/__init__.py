"""``mmcache encode``: frozen encoders run once over media, their features written to a store.

The entry point reads as plan, then run (``pipeline.run_encode``): start the job (config,
inputs surveyed in a streamed first pass, output store), ``plan.plan_encode`` names the tasks
without loading an encoder or writing anything (made as they are asked for: the inputs' second
pass), and ``pipeline.execute`` runs the plan where it fits (this process's threads, a local Dask
cluster, or an existing scheduler), a few tasks per worker in flight. ``dry_run`` prints the
first pass's plan and stops (``mmcache encode --dry-run``).

The modules, bottom up:
    config, specs             the typed config; what crosses to the workers (TaskSettings, EncoderSpec, TaskSpec)
    devices                   which accelerator a worker uses (NPU, CUDA or CPU), from a registry
    sources, inputs           reading a source's bytes safely; manifests and folders: what to encode
    sizing, media             aspect buckets and crops; decoding images and videos
    encoders/                 the encoder registry: VAEs, T5-family text, ViTs, a tokenizer, tiny stand-ins
    encoder_inputs            one input row -> what an encoder takes (shared with train's live encoders)
    daemon_pool, commit_ahead threads for inputs that may hang; committing a shard while the next encodes
    tasks, worker_plugin      what runs on a worker: load the encoders once, encode a task, commit its shard
    output_store, stale       the client's output store; committed samples whose inputs changed since
    feature_bytes             the encoders' fields and estimated bytes per sample, from their configs
    survey, plan, prompts     the inputs' first pass; plan_encode -> EncodePlan; prompt embeddings (--prompts)
    executors, pipeline       where tasks run; start, plan, execute
    dry_run                   ``mmcache encode --dry-run``: the plan, printed
    cli, demo, demo_data      the ``mmcache`` command; ``make demo`` and its generated dataset
"""
