"""``mmcache encode``: frozen encoders run once over media, their features written to a store.

The entry point reads as plan, then run (``pipeline.run_encode``): start the job, plan its tasks
without loading an encoder (``planning.plan``), run them where they fit (``runtime.executors``).
``dry_run`` prints the plan and stops. The design notes: docs/design/encode.md.

The package, bottom up:
    config          the typed config of ``mmcache encode`` (a preset + ``--set``)
    media/          frames chosen, images and videos decoded and sized, ``MediaError``
    inputs/         manifests, folders, tars, Parquet, LLaVA JSON: input rows, read safely
    encoders/       the encoder registry: VAEs, T5-family text, ViTs, a tokenizer, tiny stand-ins
    planning/       the inputs' first pass, the plan and its tasks, stale samples (on the client)
    worker/         what runs on a worker: its task values, encoders loaded once, a task into a shard
    runtime/        where tasks run (threads, a local or external Dask cluster) and their faults
    output/         the job's writes besides shards: the output store, prompts, compaction
    progress        the progress line and the sample count it is measured against
    pipeline        the client side: start, plan, execute
    dry_run         ``mmcache encode --dry-run``: the plan, printed
    cli             the ``mmcache`` command
    demo, demo_data ``make demo`` and its generated dataset
"""
