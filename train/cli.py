"""The ``mmtrain`` command. ``mmtrain fit`` runs alone or under ``torchrun --nproc-per-node K``."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator

import click

from .. import featstore
from ..featstore.cli import parse_storage_options, storage_options_option
from ..featstore.config import load_config
from ..featstore.user_errors import UserErrorGroup, check_output_location, debug_option, debug_requested, user_message
from .data.manifest import TrainingManifest


# Under torchrun, how long a rank that is not its node's first waits, on a user error met before the
# ranks' process group exists, for torchrun to stop it: its node's first rank met the same error,
# printed it and exited, and torchrun checks its workers every 0.1 s. Past the wait the error was
# not alike after all (this rank alone met it), and this rank prints its own.
ALIKE_ERROR_WAIT_S = 10.0


@click.group(cls=UserErrorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mmcache")
@debug_option
def cli(debug: bool) -> None:
    """mmtrain: train models on features cached by `mmcache encode`."""


@cli.command()
@click.option("--config", "config_name", required=True, help="YAML file or preset name (configs/train/NAME.yaml), e.g. tiny-dit.")
@click.option("--features", default=None, help="Feature store URL (a path, s3://, memory://...); or data.sources in the config to mix several.")
@click.option("--out", "run_dir", default=None, help="Run folder: metrics.jsonl, run.json, checkpoints/, model.safetensors.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Stop after this step (the LR schedule still comes from the config).")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in --out (any world size).")
@click.option("--overwrite", is_flag=True, help="Replace the run already in --out (its checkpoints, metrics and model are deleted).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value (repeatable).")
@click.option("--dry-run", is_flag=True, help="Print the run's plan (resolved config, mesh, input sizes, fields and their modes, parameters per part, the checkpoint --resume goes on from); do not train.")
@click.option("--cache-dir", default=None, metavar="DIR", help="Local read-through cache of a remote store (sets data.cache_dir; size: --set data.cache_bytes=50GiB).")
@click.option("--media", "media_root", default=None, metavar="ROOT", help="Where the media of live/train fields are now: the folder the encode manifest's paths were relative to (sets data.media_root).")
@storage_options_option
def fit(config_name, features, run_dir, steps, resume, overwrite, overrides, dry_run, cache_dir, media_root, storage_options) -> None:
    """Train on the features at --features (or those of data.sources, mixed by weight). ``--resume`` loads the checkpoint's torch DCP metadata,
    which is pickled: resume only run folders you trust."""
    with _printed_by_first_rank():
        # lazy: keeps `mmtrain --help` from importing torch
        from .config import TrainConfig

        config = load_config(TrainConfig, config_name, "train", overrides)
        if cache_dir:
            config.data.cache_dir = cache_dir
        if media_root:
            config.data.media_root = media_root
        options = parse_storage_options(storage_options)
        if dry_run:
            # lazy: keeps `mmtrain --help` from importing torch
            from .trainer import dry_run as describe

            click.echo(json.dumps(describe(config, features, options, run_dir=run_dir, resume=resume), indent=2, default=str))
            return
        if not run_dir:
            raise click.UsageError("--out RUN_DIR is required to train")
        check_output_location(run_dir, "--out")
    # lazy: keeps `mmtrain --help` from importing torch
    import torch.distributed as dist

    from .trainer import fit as run_fit

    try:
        result = run_fit(config, features, run_dir, steps=steps, resume=resume, overwrite=overwrite, storage_options=options, log=click.echo)
    except KeyboardInterrupt:
        _interrupted(run_dir)
    except ValueError as exc:
        if getattr(exc, "every_rank", False) and dist.is_initialized() and dist.get_world_size() > 1 and not debug_requested():
            _stop_every_rank(exc)
        raise
    finally:
        # An undestroyed process group can abort the interpreter at exit (its threads are
        # torn down while still joinable).
        if dist.is_initialized():
            dist.destroy_process_group()
    if result["rank"] == 0 and result["losses"]:
        click.echo(f"trained steps {result['start'] + 1}-{result['stop']}: loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}; run in {result['run_dir']}")
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        # A torchrun worker whose run has finished and closed its files: the interpreter's
        # teardown can still destroy torch's C++ threads (gloo, the rendezvous store) while they
        # are joinable and abort with "terminate called without an active exception" (about 1 in
        # 6 runs of a 4-rank fit here), which torchrun reports as a failed run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@contextlib.contextmanager
def _printed_by_first_rank() -> Iterator[None]:
    """A user error met before the ranks' process group exists (the config, --out) is met alike by
    every rank of a node, from the same arguments on the same machine: under torchrun its first
    rank (LOCAL_RANK 0) prints it, and the others wait (``ALIKE_ERROR_WAIT_S``) to be stopped by
    torchrun once it has, so the run prints one line, not one per rank."""
    try:
        yield
    except Exception as exc:
        later_rank = os.environ.get("TORCHELASTIC_RUN_ID") is not None and os.environ.get("LOCAL_RANK", "0") != "0"
        if later_rank and (isinstance(exc, click.ClickException) or user_message(exc)) and not debug_requested():
            time.sleep(ALIKE_ERROR_WAIT_S)
        raise


def _stop_every_rank(exc: ValueError) -> None:
    """An error every rank raised alike: rank 0 prints its one line, then every rank exits 1
    together (torchrun stops all ranks when the first exits: rank 0 must have printed by then)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        click.echo(f"Error: {user_message(exc)}", err=True)
    dist.barrier()
    raise click.exceptions.Exit(1) from None


def _interrupted(run_dir: str) -> None:
    """Ctrl-C: one line on rank 0 (torchrun sends SIGINT to every rank), exit code 130 (128 + SIGINT)."""
    from pathlib import Path

    from .checkpoint import resume_hint

    if int(os.environ.get("RANK", "0")) == 0:
        click.echo(f"interrupted (Ctrl-C): {resume_hint(Path(run_dir))}", err=True)
    raise click.exceptions.Exit(130)


@cli.command()
@click.option("--features", required=True, help="Feature store URL.")
@click.option("--fields", "field_names", default=None, help="Comma-separated fields (default: every field whose encoder the store records).")
@click.option("--samples", type=int, default=8, show_default=True, help="Random committed samples re-encoded per field.")
@click.option("--seed", type=int, default=0, show_default=True, help="Which random samples.")
@click.option("--media", "media_root", default=None, metavar="ROOT", help="Where the media are now (the folder the encode manifest's paths were relative to).")
@click.option("--tolerance", type=float, default=None, help="Relative L2 error allowed (default: one step of the stored dtype, i.e. storage rounding).")
@click.option("--config", "config_name", default=None, help="Train config whose encoders.<field> sections (path, rebuild, resize) apply.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="e.g. --set encoders.latent.path=DIR (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@storage_options_option
def drift(features, field_names, samples, seed, media_root, tolerance, config_name, overrides, as_json, storage_options) -> None:
    """Re-encode a few cached samples live with the recorded encoders and compare (max abs error,
    relative L2 error, cosine). Exit code 1 when a field differs by more than the tolerance."""
    import sys

    # lazy: keeps `mmtrain --help` from importing torch
    from .config import TrainConfig
    from .live.drift import measure_drift, pick_samples
    from .live.reattach import reattach_field

    if samples < 1:
        raise click.UsageError("--samples must be >= 1")
    config = load_config(TrainConfig, config_name, "train", overrides)
    options = parse_storage_options(storage_options)
    store = featstore.open(features, options)
    names = [n.strip() for n in field_names.split(",") if n.strip()] if field_names else [n for n, f in store.fields.items() if "encoder" in f.meta]
    if not names:
        raise click.UsageError(f"{store.url} records no encoder for any field; name them with --fields (and --set encoders.<field>.rebuild...)")
    manifest = TrainingManifest.from_config(config.data, options, store)  # the conversations a tokenizer field was encoded from
    reports = []
    for name in names:
        live = reattach_field(store, name, config.encoders.get(name), media_root=media_root or config.data.media_root,
                              storage_options=options, check_fingerprint=False)
        reports.append(measure_drift(store, live, pick_samples(store, name, samples, seed, manifest), tolerance, manifest=manifest))
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        for report in reports:
            click.echo(report.line())
    if not all(r.ok for r in reports):
        click.echo("drift above tolerance: the cached features no longer match their encoder; re-encode the field(s) marked DRIFT", err=True)
        sys.exit(1)


@cli.command()
@click.option("--run", "run", required=True, metavar="RUN_DIR", help="A run folder (mmtrain fit --out) or an export (mmtrain export --out).")
@click.option("--checkpoint", type=int, default=None, metavar="STEP", help="A checkpoint's step (default: the final weights, else the newest checkpoint).")
@click.option("--prompt", multiple=True, help="A prompt (repeatable); VLM runs: a question (about each --image, or on its own without one).")
@click.option("--prompts", "prompts_file", default=None, metavar="FILE", help="Prompts, one per line.")
@click.option("--out", required=True, metavar="DIR", help="Where the PNGs / WebPs, grid.png and samples.json go.")
@click.option("--seed", "seeds", type=int, multiple=True, help="A seed (repeatable; default 0): one sample per prompt and seed.")
@click.option("--steps", type=int, default=20, show_default=True, help="Euler steps.")
@click.option("--guidance", type=float, default=None, help="Classifier-free guidance scale with the empty prompt (1.0 = none; default: 1.0, or 4.0 for a run trained with caption dropout).")
@click.option("--shift", type=float, default=1.0, show_default=True, help="Timestep shift (SD3); > 1 spends more steps at high noise.")
@click.option("--size", default=None, metavar="WxH", help="Pixels (default: the commonest size in the run's store).")
@click.option("--frames", type=int, default=1, show_default=True, help="Frames (1 = an image; a video is written as animated WebP).")
@click.option("--fps", type=float, default=8.0, show_default=True, help="Frame rate of animated outputs.")
@click.option("--vae", default=None, metavar="DIR", help="The VAE folder the store was encoded with (checked against its fingerprint).")
@click.option("--latents-only", is_flag=True, help="Write the sampled latents (latents.safetensors) instead of decoding them.")
@click.option("--features", default=None, help="Feature store URL for the prompts' embeddings (default: the run's store).")
@click.option("--image", "images", multiple=True, metavar="PATH", help="VLM runs: an image to answer about (repeatable).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="VLM runs: 0 = greedy answers; > 0 samples (with --seed).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="VLM runs: nucleus sampling's probability mass (with --temperature).")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="VLM runs: the longest answer.")
@click.option("--device", default="cpu", show_default=True, metavar="DEVICE",
              help="cpu, cuda, npu (cuda:N / npu:N), or auto: the trainer's pick (NPU, else CUDA, else CPU). float32 on any.")
@storage_options_option
def sample(run, checkpoint, prompt, prompts_file, out, seeds, steps, guidance, shift, size, frames, fps, vae, latents_only, features, images,
           temperature, top_p, max_new_tokens, device, storage_options) -> None:
    """Sample pictures from a trained DiT: a PNG per prompt and seed (WebP for videos), grid.png,
    samples.json. From a VLM: answers about each --image (to each --prompt, or a caption without
    one), or to each --prompt alone without --image, in answers.jsonl. Same run, input, seed and
    device -> the same bytes."""
    # lazy: keeps `mmtrain --help` from importing torch
    from .sample.command import sample_command

    check_output_location(out, "--out")
    doc = sample_command(run, checkpoint=checkpoint, prompt=prompt, prompts_file=prompts_file, out=out, seeds=seeds, steps=steps,
                         guidance=guidance, shift=shift, size=size, frames=frames, fps=fps, vae=vae, latents_only=latents_only,
                         features=features, storage_options=parse_storage_options(storage_options), images=images,
                         temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, device=device)
    if doc.get("warning"):
        click.echo(f"warning: {doc['warning']}", err=True)
    what = doc.get("note") or f"{len(doc['samples'])} sample(s)"
    click.echo(f"{what} from {doc['weights']} -> {out}")


@cli.command("export")
@click.argument("run_dir")
@click.option("--out", required=True, metavar="DIR", help="A new folder for the exported model.")
@click.option("--checkpoint", type=int, default=None, metavar="STEP", help="A checkpoint's step (default: the final weights, else the newest checkpoint).")
def export(run_dir, out, checkpoint) -> None:
    """Write a run's model (safetensors + config.json, or the family's own format) from any checkpoint."""
    # lazy: keeps `mmtrain --help` from importing torch
    from .sample.source import export_run

    check_output_location(out, "--out")
    result = export_run(run_dir, out, checkpoint)
    click.echo(f"exported step {result['step']} ({result['weights']}) -> {result['out']}: {', '.join(result['files'])}")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
