"""``mmcache info``, ``verify``, ``copy``, ``repair`` and ``compact``: the store commands, which need neither torch nor dask.
``mmcache.precompute.cli`` adds ``encode`` to this group; the ``mmcache`` script points there. User
errors print one line (``mmcache.featstore.user_errors``); ``--debug`` shows the traceback."""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import click

from .copy import copy_store
from .errors import FeatstoreError
from . import secrets
from .checkpoints import CheckpointWarning
from .compact import compact_store
from .reader import open_store
from .cache import parse_size
from .repair import repair_store
from .rewrite import DEFAULT_GRACE_S, DataCompaction, compact_data
from .secrets import redact
from .store import Store
from .user_errors import UserErrorGroup, check_output_location, debug_option
from .verify import store_info, verify_store


def parse_storage_options(raw: str | None) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--storage-options") from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--storage-options")
    secrets.register(value)  # so no message can show them
    return value


storage_options_option = click.option(
    "--storage-options", "storage_options", default=None, metavar="JSON",
    help='fsspec options for the URL, e.g. \'{"anon": true}\'. The standard AWS variables '
    "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE) work without it.",
)


@click.group(cls=UserErrorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mmcache")
@debug_option
def cli(debug: bool) -> None:
    """mmcache: encode media once into a feature store, then train on the cached features."""
    _plain_store_warnings()


def _plain_store_warnings() -> None:
    """A damaged index checkpoint is a warning (nothing is lost: the parts are read instead);
    on the command line it reads as one line, like the other warnings, not as Python's."""
    python_format = warnings.formatwarning

    def plain(message, category, filename, lineno, line=None):  # type: ignore[no-untyped-def]
        if issubclass(category, CheckpointWarning):
            return f"warning: {message}\n"
        return python_format(message, category, filename, lineno, line)

    warnings.formatwarning = plain


@cli.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@storage_options_option
def info(url: str, as_json: bool, storage_options: str | None) -> None:
    """Summarise the store at URL: samples, shards, fields, size, rejects."""
    with _open(url, storage_options) as store:
        summary = _guarded(store_info, store)
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        echo_info(summary)


def echo_info(summary: dict[str, Any]) -> None:
    """The human-readable form of ``store_info``."""
    click.echo(f"store          {summary['url']}")
    click.echo(f"format version {summary['format_version']}")
    click.echo(f"samples        {summary['num_samples']:,} in {summary['num_shards']:,} shard(s), {_human(summary['bytes'])}")
    for name, spec in summary["fields"].items():
        extras = ", ".join(sorted(spec["meta"])) if spec["meta"] else ""
        held = summary["samples_per_field"][name]
        partial = f", in {held:,} of the samples" if held != summary["num_samples"] else ""
        click.echo(f"field          {name}: {spec['dtype']}, {spec['ndim']}-D{partial}" + (f" [{extras}]" if extras else ""))
    checkpoint = summary["checkpoint"]
    if checkpoint["key"]:
        click.echo(f"index          checkpoint {checkpoint['key']} covers {checkpoint['covered']:,} of the shards")
    else:
        click.echo("index          no checkpoint (an open reads every index part; `mmcache compact` writes one)")
    inputs = list(summary.get("samples_by_input", {}).items())
    for name, count in inputs[:10]:
        click.echo(f"input          {count:,} sample(s) from {name}")
    if len(inputs) > 10:
        click.echo(f"input          ... and {len(inputs) - 10:,} more input(s)")
    click.echo(f"rejected       {summary['num_rejected']:,}")
    reasons = list(summary["rejects_by_reason"].items())
    for reason, count in reasons[:10]:  # a reason naming its file is one line per reject: the commonest ten
        click.echo(f"  {count:6,}  {reason}")
    if len(reasons) > 10:
        click.echo(f"  ... and {len(reasons) - 10:,} more reason(s): `mmcache info --json` lists them all")


@cli.command("import")
@click.argument("src")
@click.argument("dst")
@click.option("--config", "config_name", default=None, help="YAML file or preset name (configs/import/NAME.yaml).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a setting: layout=musubi, fields.latent='latents_*', fields.text='t5_*'.")
@storage_options_option
def import_(src: str, dst: str, config_name: str | None, overrides: tuple[str, ...], storage_options: str | None) -> None:
    """Bring a per-sample cache (SimpleTuner, finetrainers, musubi-tuner, MindSpeed-MM) at SRC into a new store at DST
    (run again after an interruption, it imports only what is left)."""
    from .config import load_config
    from .importer import ImportConfig, import_cache  # lazy: its loaders import torch

    config = load_config(ImportConfig, config_name, "import", overrides)
    check_output_location(dst, "DST")
    report = import_cache(src, dst, layout_name=config.layout, fields=config.fields,
                          storage_options=parse_storage_options(storage_options), log=lambda line: click.echo(line, err=True))
    click.echo(f"imported {report.imported} sample(s) into {redact(dst)}, {report.rejected} rejected"
               + (f", {report.already} imported or rejected by an earlier run" if report.already else "")
               + "".join(f"\n  {count:6,}  {reason}" for reason, count in report.reasons.items()))


@cli.command()
@click.argument("url")
@storage_options_option
@click.option("--quiet", "-q", is_flag=True, help="Print problems only.")
def verify(url: str, storage_options: str | None, quiet: bool) -> None:
    """Check every committed byte of the store at URL; exit 1 on any problem."""
    with _open(url, storage_options, strict=False) as store:
        report = _guarded(verify_store, store)
    for line in report.replaced if not quiet else ():
        click.echo(f"note: {line}", err=True)
    for line in report.warnings:
        click.echo(f"warning: {line}", err=True)
    for line in report.problems:
        click.echo(f"problem: {line}", err=True)
    if not quiet or not report.ok:
        status = "OK" if report.ok else f"FAILED ({len(report.problems)} problem(s))"
        prompts = f", {report.prompts_checked} prompt-embedding object(s)" if report.prompts_checked else ""
        click.echo(f"{status}: {report.shards_checked} shard(s), {report.samples_checked} sample(s){prompts}, {_human(report.bytes_checked)} checked")
    sys.exit(0 if report.ok else 1)


@cli.command()
@click.argument("src")
@click.argument("dst")
@storage_options_option
@click.option("--src-storage-options", default=None, metavar="JSON", help="fsspec options for SRC only (default: --storage-options).")
@click.option("--dst-storage-options", default=None, metavar="JSON", help="fsspec options for DST only (default: --storage-options).")
@click.option("--workers", type=int, default=8, show_default=True, help="Objects copied in parallel.")
@click.option("--verify/--no-verify", "check", default=False, help="Afterwards, re-read every byte of DST as `mmcache verify` does.")
@click.option("--progress/--no-progress", default=None, help="Progress line (default: when stderr is a terminal).")
@click.option("--merge", is_flag=True, help="DST may be another store with the same fields: add SRC's samples that DST lacks.")
def copy(src, dst, storage_options, src_storage_options, dst_storage_options, workers, check, progress, merge) -> None:
    """Copy the store at SRC to DST (any two URLs). Parallel, checked against the store's
    checksums, committed shard by shard (a reader of DST never sees half a shard); run it again
    after an interruption and it copies only what is missing. DST must be new or an earlier copy
    of SRC, unless --merge, and lie neither inside SRC nor around it."""
    check_output_location(dst, "DST")
    both = parse_storage_options(storage_options)
    src_options = parse_storage_options(src_storage_options) or both
    dst_options = parse_storage_options(dst_storage_options) or both
    show = sys.stderr.isatty() if progress is None else progress

    def report(done: int, total: int, nbytes: int) -> None:
        if show:
            click.echo(f"\r{done}/{total} shards, {_human(nbytes)}   ", err=True, nl=False)

    try:
        summary = copy_store(src, dst, src_options, dst_options, workers=workers, progress=report, merge=merge)
        if show:
            click.echo("", err=True)
        click.echo(summary.line())
        if check:
            with open_store(dst, dst_options, strict=False) as store:
                result = verify_store(store)
            for line in result.problems:
                click.echo(f"problem: {line}", err=True)
            if not result.ok:
                raise click.ClickException(f"{dst}: verify FAILED ({len(result.problems)} problem(s))")
            click.echo(f"verified: {result.shards_checked} shard(s), {result.samples_checked} sample(s), {_human(result.bytes_checked)}")
    except FeatstoreError as exc:
        raise click.ClickException(redact(exc)) from None


@cli.command()
@click.argument("url")
@storage_options_option
def repair(url: str, storage_options: str | None) -> None:
    """Remove the rows of URL that readers ignore: a (sample id, field) that racing writers both
    committed is kept in the earliest commit only. Moves no data; safe while others read."""
    try:
        store = open_store(url, parse_storage_options(storage_options), mode="a")
    except FeatstoreError as exc:
        raise click.ClickException(redact(exc)) from None
    with store:
        summary = _guarded(repair_store, store)
    click.echo(summary.line())


@cli.command()
@click.argument("url")
@storage_options_option
@click.option("--rebuild", is_flag=True, help="Read every index part, ignoring existing checkpoints, and delete them afterwards (when `mmcache verify` says one disagrees with the parts); implies --index-only.")
@click.option("--target-bytes", default="256MiB", show_default=True, metavar="SIZE",
              help="Rewrite shards under a quarter of this into shards of about this size (data compaction).")
@click.option("--grace", "grace_s", type=float, default=DEFAULT_GRACE_S, show_default=True, metavar="SECONDS",
              help="Delete the objects of shards replaced by a data compaction at least this long ago.")
@click.option("--index-only", is_flag=True, help="Only checkpoint the index: no data compaction, nothing deleted.")
def compact(url: str, storage_options: str | None, rebuild: bool, target_bytes: str, grace_s: float, index_only: bool) -> None:
    """Compact the store at URL: rewrite its small shards into shards of about --target-bytes
    (each switch one atomic commit; the old objects deleted after --grace), then checkpoint its
    index, so that opening it reads one Parquet object instead of every index part. Safe while
    others read, write or compact. Writers and `mmcache encode` also do this every so often."""
    options = parse_storage_options(storage_options)
    try:
        settings = DataCompaction(target_bytes=parse_size(target_bytes, "--target-bytes"), grace_s=grace_s)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if not index_only and not rebuild:  # a rebuild mends the index: no data is read through it first
        # Not strict: a damaged index part is left out (and so never rewritten), as the index
        # step below lists it; the rest is still compacted.
        with _open(url, storage_options, strict=False) as store:
            click.echo(_guarded(lambda: compact_data(store, settings, options)).line())
    try:  # the store's index is what this reads, once, below
        store = open_store(url, options, load_index=False)
    except FeatstoreError as exc:
        raise click.ClickException(redact(exc)) from None
    with store:
        summary = _guarded(lambda: compact_store(store.storage, rebuild=rebuild))
    click.echo(summary.line())


def _guarded(fn, *args):
    try:
        return fn(*args)
    except FeatstoreError as exc:
        raise click.ClickException(redact(exc)) from None


def _open(url: str, storage_options: str | None, strict: bool = True) -> Store:
    try:
        return open_store(url, parse_storage_options(storage_options), strict=strict)
    except FeatstoreError as exc:
        raise click.ClickException(redact(exc)) from None


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
