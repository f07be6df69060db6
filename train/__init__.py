"""``mmtrain``: train on cached features, launched alone or by ``torchrun``.

``mmtrain fit`` is plan, then run (design: docs/design/train.md). The folders and root modules:
    config, plan        the typed config; plan_run -> RunPlan (what --dry-run prints)
    data/               the data side: streaming features into steps, order, balance, packing, sources
    models/             the model registry: the DiT and its data side, the VLM (projector + LLM)
    objective           flow matching and the loss contract every family follows
    parallel/           meshes (dims), FSDP2, USP sequence parallelism (sequence/), parallelize
    live/               joint finetuning: encoders re-attached live or trained, drift checks
    sample/             sampling, validation during fit, mmtrain sample / export
    encoding            the one seam into mmcache.precompute (live encoders, sampling)
    checkpoint, run_dir, run_files, failures   DCP checkpoints; the run folder; machine failures
    trainer, cli        the Trainer and fit; the ``mmtrain`` command
"""
