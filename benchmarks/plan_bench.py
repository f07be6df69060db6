"""Planning a large manifest: wall time and peak RSS of ``mmcache encode --dry-run`` (the
streamed planner: ``precompute.planning.survey``), against the client-side reading the planner did before
(``precompute.inputs.manifest.read_inputs``, still the reader of folders and of the trainer's live
manifest: every row an ``InputRow``, every file resolved and stat'ed on the client, duplicate ids
in a set) followed by naming every task of 32 rows (``plan.plan_tasks``), measured in the same run.

    python benchmarks/plan_bench.py [--rows 200000 2000000] [--old-max-rows 200000]

The manifests are JSONL with ids, captions of ~60 characters and paths to 16 real tiny PNG
files (repeated: a path per row is what the planner reads; the files are never decoded), plus
0.1% rows repeating an earlier id. Each figure is one child process: its wall and CPU time and
its ``ru_maxrss``, so the parent's memory is not counted; B/row is the peak's growth over the
same planner's on 1,000 rows, per row. The old planner here shares this branch's faster caption
and suffix checks (so it is faster than the code it stands for). Config: the ``tiny`` preset
(its encoders are built from their configs, not loaded; torch is imported for that). Targets
(issue 32): a 2M-row dry run in <= 30 s and <= 350 MB peak RSS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The old planner: the whole manifest read into rows (files checked here), then every task named.
OLD_PLANNER = """
import sys
from mmcache.precompute.inputs import read_inputs
from mmcache.precompute.planning.plan import plan_tasks
rows, rejects = read_inputs(sys.argv[1])
tasks = plan_tasks(rows, "digest", 32, ["latent", "text_emb"])
print(len(rows), len(rejects), len(tasks))
"""


def write_inputs(folder: Path, rows: int) -> Path:
    """A JSONL manifest of ``rows`` rows (0.1% repeating an earlier id) over 16 tiny PNG files."""
    from PIL import Image

    media = folder / "media"
    media.mkdir(parents=True, exist_ok=True)
    for i in range(16):
        Image.new("RGB", (32, 32), (i * 15, 100, 200)).save(media / f"img_{i:02d}.png")
    manifest = folder / f"manifest_{rows}.jsonl"
    with open(manifest, "w") as out:
        for i in range(rows):
            sample = i - 7 if i % 1000 == 999 else i  # a repeated id
            row = {"id": f"s{sample:09d}", "path": f"media/img_{i % 16:02d}.png", "caption": f"a small square picture, number {i}, in blue and teal"}
            out.write(json.dumps(row) + "\n")
    return manifest


def run_child(command: list[str]) -> tuple[float, float, float, str]:
    """(wall seconds, CPU seconds, peak RSS in MB, stdout) of ``command``, run by a fresh wrapper
    process whose RUSAGE_CHILDREN is then that child's alone. CPU time is shown besides wall time:
    on a shared machine the wall time is mostly other processes' (both are printed)."""
    wrapper = ("import json, resource, subprocess, sys, time\n"
               "t = time.perf_counter(); p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
               "print(json.dumps([time.perf_counter() - t, u.ru_utime + u.ru_stime, u.ru_maxrss / 1024, p.returncode, p.stdout, p.stderr[-2000:]]))")
    done = subprocess.run([sys.executable, "-c", wrapper, *command], capture_output=True, text=True, cwd=ROOT, check=True)
    seconds, cpu, rss, code, out, err = json.loads(done.stdout)
    if code:
        raise SystemExit(f"{' '.join(command)} failed:\n{err}")
    return seconds, cpu, rss, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[200_000, 2_000_000])
    parser.add_argument("--old-max-rows", type=int, default=200_000, help="the old planner runs at sizes up to this only")
    args = parser.parse_args()
    mmcache = [sys.executable, "-m", "mmcache.precompute.cli", "encode", "--config", "tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        def dry(manifest: Path) -> tuple[float, float, float, str]:
            return run_child([*mmcache, "--input", str(manifest), "--output", str(folder / "out"), "--dry-run"])

        def old(manifest: Path) -> tuple[float, float, float, str]:
            return run_child([sys.executable, "-c", OLD_PLANNER, str(manifest)])

        # Each planner's peak on 1,000 rows: its imports (the dry run's include torch, for the
        # encoders' configs), so that the growth with the rows is shown apart.
        small = write_inputs(folder, 1000)
        base = {"streamed": dry(small)[2], "old": old(small)[2]}
        print(f"baseline peak RSS at 1,000 rows: streamed {base['streamed']:.0f} MB, old {base['old']:.0f} MB")
        print(f"{'rows':>9} {'planner':>8} {'wall s':>7} {'CPU s':>6} {'peak MB':>8} {'B/row':>6}  new/old: wall, CPU, RSS growth")
        for rows in args.rows:
            manifest = write_inputs(folder, rows)
            new_s, new_cpu, new_mb, out = dry(manifest)
            assert not (folder / "out").exists(), "a dry run wrote its output"
            new_row = (new_mb - base["streamed"]) * 2**20 / rows
            print(f"{rows:>9} {'streamed':>8} {new_s:>7.1f} {new_cpu:>6.1f} {new_mb:>8.0f} {new_row:>6.0f}", flush=True)
            if rows <= args.old_max_rows:
                old_s, old_cpu, old_mb, _ = old(manifest)
                old_row = (old_mb - base["old"]) * 2**20 / rows
                print(f"{rows:>9} {'old':>8} {old_s:>7.1f} {old_cpu:>6.1f} {old_mb:>8.0f} {old_row:>6.0f}  "
                      f"{new_s / old_s:.2f}x, {new_cpu / old_cpu:.2f}x, {new_row / old_row:.2f}x", flush=True)
            for line in out.splitlines()[1:]:
                print(f"{'':>10}{line}")
            manifest.unlink()


if __name__ == "__main__":
    main()
