"""The ``mmtrain`` command. ``mmtrain fit`` runs alone or under ``torchrun --nproc-per-node K``."""

from __future__ import annotations

import json

import click

from featstore.cli import parse_storage_options, storage_options_option
from featstore.user_errors import UserErrorGroup, check_output_location, debug_option


@click.group(cls=UserErrorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mmcache")
@debug_option
def cli(debug: bool) -> None:
    """mmtrain: train models on features cached by `mmcache encode`."""


@cli.command()
@click.option("--config", "config_name", required=True, help="YAML file or preset name (configs/train/NAME.yaml), e.g. tiny-dit.")
@click.option("--features", required=True, help="Feature store URL (a path, s3://, memory://...).")
@click.option("--out", "run_dir", default=None, help="Run folder: metrics.jsonl, run.json, checkpoints/, model.safetensors.")
@click.option("--steps", type=int, default=None, help="Stop after this step (the LR schedule still comes from the config).")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in --out (any world size).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value (repeatable).")
@click.option("--dry-run", is_flag=True, help="Print the resolved config, mesh and parameter count; do not train.")
@click.option("--cache-dir", default=None, metavar="DIR", help="Local read-through cache of a remote store (sets data.cache_dir; size: --set data.cache_bytes=50GiB).")
@storage_options_option
def fit(config_name, features, run_dir, steps, resume, overrides, dry_run, cache_dir, storage_options) -> None:
    """Train on the features at --features. ``--resume`` loads the checkpoint's torch DCP metadata,
    which is pickled: resume only run folders you trust."""
    from featstore.config import load_config
    from train.config import TrainConfig

    config = load_config(TrainConfig, config_name, "train", overrides)
    if cache_dir:
        config.data.cache_dir = cache_dir
    options = parse_storage_options(storage_options)
    if dry_run:
        from train.trainer import dry_run as describe

        click.echo(json.dumps(describe(config, features, options), indent=2, default=str))
        return
    if not run_dir:
        raise click.UsageError("--out RUN_DIR is required to train")
    check_output_location(run_dir, "--out")
    from train.trainer import fit as run_fit

    import torch.distributed as dist

    try:
        result = run_fit(config, features, run_dir, steps=steps, resume=resume, storage_options=options, log=click.echo)
    finally:
        # An undestroyed process group can abort the interpreter at exit (its threads are
        # torn down while still joinable).
        if dist.is_initialized():
            dist.destroy_process_group()
    if result["rank"] == 0 and result["losses"]:
        click.echo(f"trained steps {result['start'] + 1}-{result['stop']}: loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}; run in {result['run_dir']}")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
