"""The ``mmcache`` command: the store commands from ``mmcache.featstore.cli`` plus ``encode``.
Heavy imports (torch, dask, encoders) happen inside the commands that need them, so
``mmcache info`` stays fast and works without them."""

from __future__ import annotations

import sys

import click

from ..featstore.cli import cli, parse_storage_options, storage_options_option
from ..featstore.config import load_config
from ..featstore.user_errors import check_output_location
from .config import EncodeConfig
from .output.prompts import load_prompt_file
from .runtime.devices import DEVICES
from .runtime.interrupt import Interrupted, raising_on_signals


@cli.command()
@click.option("--config", "config_name", required=True, help="YAML file or preset name (configs/encode/NAME.yaml), e.g. tiny, taef2.")
@click.option("--input", "input_urls", required=True, multiple=True,
              help="Manifest (.jsonl/.csv/.parquet), folder of media + .txt captions, WebDataset .tar, Parquet with image bytes, "
                   "or LLaVA .json; repeatable; brace ranges and globs: 's3://b/{00000..00099}.tar' (docs/encode.md).")
@click.option("--output", "output_url", required=True, help="Store URL: a path, file://, s3://, memory://.")
@click.option("--workers", type=int, default=None, help="Local Dask workers (default: one per device, or per CPU core up to 4).")
@click.option("--scheduler", default=None, help="Address of an existing Dask scheduler (instead of a local cluster).")
@click.option("--device", type=click.Choice(DEVICES), default=None, help="Overrides the config's device.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value, e.g. --set vae.path=DIR (repeatable).")
@storage_options_option
@click.option("--input-storage-options", default=None, metavar="JSON", help="fsspec options for the input URLs.")
@click.option("--progress/--no-progress", default=None, help="Progress line (default: when stderr is a terminal).")
@click.option("--allow-empty", is_flag=True, help="An input with no rows at all is not an error (sets data.allow_empty).")
@click.option("--dry-run", is_flag=True, help="Print the plan (rows, duplicates, rejects, tasks, estimated shards and bytes); "
                                             "load no encoder, write nothing.")
@click.option("--prompts", "prompts_file", default=None, metavar="FILE", help="Validation prompts (one per line): their text embeddings are stored for `mmtrain sample` and sampling during fit.")
def encode(config_name, input_urls, output_url, workers, scheduler, device, overrides, storage_options, input_storage_options, progress, allow_empty,
           dry_run, prompts_file) -> None:
    """Run frozen encoders over INPUT once and write their features to the store at OUTPUT."""
    if workers is not None and scheduler:
        raise click.UsageError("--workers and --scheduler exclude each other")
    if dry_run and scheduler:
        raise click.UsageError("--dry-run plans on this machine: leave out --scheduler (--workers N plans for N workers)")
    # lazy: the encode pipeline is imported only by `encode`, so `mmcache --help`/`info` stay fast
    from .pipeline import run_encode

    config = load_config(EncodeConfig, config_name, "encode", overrides)
    prompts = load_prompt_file(prompts_file) if prompts_file else None
    check_output_location(output_url, "--output")
    if device:
        config.device = device
    if allow_empty:
        config.data.allow_empty = True
    if dry_run:
        from .dry_run import dry_run as plan_only

        report = plan_only(config, list(input_urls), output_url, workers=workers, storage_options=parse_storage_options(storage_options),
                           input_storage_options=parse_storage_options(input_storage_options))
        for line in report.lines():
            click.echo(line)
        return
    summary = run_encode(
        config, list(input_urls), output_url, workers=workers, scheduler=scheduler,
        storage_options=parse_storage_options(storage_options),
        input_storage_options=parse_storage_options(input_storage_options),
        progress=progress, prompts=prompts, log=lambda line: click.echo(line, err=True),
    )
    if summary.samples_written + summary.rejected + summary.samples_skipped == 0:
        click.echo(f"warning: the input {' '.join(input_urls)} is empty; nothing was encoded", err=True)
    click.echo(summary.line())


def main() -> None:
    """Every command: Ctrl-C or SIGTERM ends it with one line and exit 130 / 143 (``encode`` first
    stops its tasks at a sample boundary: precompute.runtime.interrupt), never a traceback."""
    try:
        with raising_on_signals():
            cli()
    except Interrupted as stopped:
        click.echo(stopped.line(), err=True)
        sys.exit(stopped.exit_code)


if __name__ == "__main__":
    main()
