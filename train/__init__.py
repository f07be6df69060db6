"""``mmtrain``: train on cached features, launched alone or by ``torchrun``.

``mmtrain fit`` reads as plan, then run (``trainer.fit``): ``plan.plan_run`` settles the run
(config, meshes, input sizes, fields and their modes, parameters per part, the checkpoint it
resumes; what ``--dry-run`` prints), the model is built and laid out by
``parallel.parallelize`` (``apply_*`` in one fixed order), and a small ``Trainer`` runs
``train_step`` / ``evaluate`` / ``log`` / ``save``. Models hold no distributed code.

The packages and modules:
    config, plan              the typed config; plan_run -> RunPlan
    models/                   the model registry: the DiT and its data side, the VLM (projector + LLM)
    objective                 flow matching and the loss contract every family follows
    data, order, balance      streaming features into steps; the epoch order; cost-balanced batches
    packing                   VLM samples packed whole into rows with a block-diagonal causal mask
    parallel/                 meshes (dims), FSDP2, USP sequence parallelism (sequence/), parallelize
    live/                     joint finetuning: encoders re-attached live or trained, drift checks
    sample/                   sampling, validation during fit, mmtrain sample / export
    checkpoint, run_files     DCP checkpoints; what a run writes into its folder
    trainer, cli              the Trainer and fit; the ``mmtrain`` command
"""
