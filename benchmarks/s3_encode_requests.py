"""What `mmcache encode` costs on S3 against local disk, and which requests it sends, per phase,
for one or more commits (by hand, not a test; issue 47: "encoding into S3 got slower").

    python benchmarks/s3_encode_requests.py [--trees HEAD,<commit>,...] [--reps 3] [--images 91 --videos 8]
                                            [--latency 0.02] [--json FILE [--dump-requests]] [--keep-worktrees]

(``HEAD`` is the commit HEAD names, checked out apart: edits in this checkout are measured only as
``.``.) One tree takes about 1 + 2 x --reps encodes of ~10-15 s each on a quiet 2-core machine.

The job: ``mmcache encode --config tiny --workers 2 --set run.samples_per_task=8`` of samples made
by ``mmcache.precompute.demo_data.make_dataset`` (91 images + 8 videos = 99 samples: 13 tasks, so
13 shards), once to a fresh local folder and once to ``s3://<fresh bucket>/store`` on the tests'
moto server (``tests.s3_server.S3ServerProcess``: a child process, over HTTP on 127.0.0.1; a bucket
of its own per run, since moto lists a prefix by walking its whole bucket).

Each tree (a commit, checked out with ``git worktree add --detach`` under /tmp/wt-<sha>, removed at
the end unless --keep-worktrees; ``.`` is this checkout as it is) runs in a fresh ``python -S``
whose ``sys.path`` is a folder whose ``mmcache`` links to that tree (or, for trees from before the
checkout's root was the package, to its three packages) plus this virtualenv's site-packages: the
editable install's finder is not loaded, the Dask workers (spawned) inherit that path, and the child
reports which featstore it imported (the run stops if it is not the tree's). The trees and the
two destinations alternate: for each repetition, every tree runs local then S3.

Printed per tree: the wall time of the whole command (process start to exit) local and S3, and
their ratio time local / time S3 (best of --reps and median), the phases' durations, and the
requests the S3 server answered during the S3 runs (counted by the server itself), by kind
(method + what the key is: ``index/`` part, ``index/_checkpoint`` marker, ``checkpoints/``,
``shards/``, ``declarations/``, root ``zarr.json``, ``rejects/``, ``prompts/``, a listing and of
which prefix) and by phase. Phases come from the child's clock (time.perf_counter is
CLOCK_MONOTONIC, the server's too), marked by wrapping the pipeline's functions where the tree
has them:

  cli         before run_encode (the output location checked)
  start       run_encode up to planning, less the three below: the encoders' specs, the survey
  start: open store   the output store looked for (its snapshot: pipeline.open_existing)
  start: cluster      the local cluster started (entering pipeline.open_executor)
  start: encoders, store, prompts   pipeline._open_store: the encoders loaded on the workers waited
                      for, the store created or checked, the prompts' embeddings stored
  plan        plan_encode (with streamed planning the tasks are made later, inside ``tasks``)
  tasks       execute: the plan's rejects, every task's encode and commit (by the workers), duplicates
  data compaction   precompute.output.compaction._compact_data (its open, the rewrite tasks)
  index checkpoint  featstore.compact.compact_when / compact_at_close at the job's end (listing, compact_store)
  end other   the rest of compact_after_job
  close       run_encode after its last phase: the cluster closing
  exit        after run_encode returned

A request is counted in the innermost phase whose span holds its start. Counts are the median
over the S3 runs (they are deterministic but for the races between sibling commits: +-2);
"per shard" divides by the shards the tasks committed (13). "Round trips" are the stretches of
time with a request in flight (tests.s3_server.rounds): with --latency (seconds added to every
answer, an object store farther away than loopback) they are what a phase pays per unit of
latency; at 0 latency few requests overlap, so they count nearly every request.

For reference (issue 47, 99 samples, 13 shards of 2 fields): 222 requests a job at 8b28a3d and
1306264 = 5 at the start + 115 for the tasks (5 data PUTs, 1 LIST index/, 1 conditional PUT of
the index part per shard, and ~24 GETs of sibling tasks' index parts) + 92 for the end-of-job data
compaction (added by 8564ef7) + 10 for the index checkpoint; 142 before 8564ef7 (the checkpoint
then 22: it read the 13 parts).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("featstore", "precompute", "train")
PHASES = ("cli", "start", "start: open store", "start: cluster", "start: encoders, store, prompts", "plan", "tasks", "data compaction", "index checkpoint", "end other", "close", "exit")
# (module, attribute, phase): wrapped in the child where the tree has them (innermost wins).
MARKS = (
    ("mmcache.precompute.pipeline", "run_encode", "job"),
    ("mmcache.precompute.pipeline", "open_existing", "start: open store"),  # the survey's snapshot
    ("mmcache.precompute.pipeline", "open_executor", "start: cluster"),
    ("mmcache.precompute.pipeline", "_open_store", "start: encoders, store, prompts"),
    ("mmcache.precompute.pipeline", "plan_encode", "plan"),
    ("mmcache.precompute.pipeline", "execute", "tasks"),
    ("mmcache.precompute.pipeline", "compact_after_job", "end other"),
    ("mmcache.precompute.output.compaction", "_compact_data", "data compaction"),
    ("mmcache.precompute.job_compaction", "_compact_data", "data compaction"),  # before precompute/output/
    ("mmcache.precompute.job_compaction", "compact_data", "data compaction"),  # its first form: no _compact_data
    ("mmcache.featstore.compact", "compact_when", "index checkpoint"),
    ("mmcache.featstore.compact", "compact_at_close", "index checkpoint"),  # from e461603 on
)


# ---- the child: one encode, its phases marked ------------------------------------------------------
def child(marks_path: str, argv: list[str]) -> None:
    import importlib
    import time as _time

    spans: list[list] = []
    t_begin = _time.perf_counter()

    def wrap(module: str, attr: str, phase: str) -> None:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            return
        fn = getattr(mod, attr, None)
        if fn is None or getattr(fn, "_marked", False):
            return

        class Entered:
            """A context manager whose __enter__ is the span (the cluster starts there)."""

            def __init__(self, cm):
                self.cm = cm

            def __enter__(self):
                span = [phase, _time.perf_counter(), None]
                spans.append(span)
                try:
                    return self.cm.__enter__()
                finally:
                    span[2] = _time.perf_counter()

            def __exit__(self, *exc):
                return self.cm.__exit__(*exc)

        def marked(*args, **kwargs):
            if phase == "start: cluster":
                return Entered(fn(*args, **kwargs))
            span = [phase, _time.perf_counter(), None]
            spans.append(span)
            try:
                result = fn(*args, **kwargs)
                if phase == "job":
                    span.append({"seconds": getattr(result, "seconds", None), "startup": getattr(result, "startup_seconds", None),
                                 "samples": getattr(result, "samples_written", None), "tasks": getattr(result, "tasks", None)})
                return result
            finally:
                span[2] = _time.perf_counter()

        marked._marked = True  # type: ignore[attr-defined]
        setattr(mod, attr, marked)

    for module, attr, phase in MARKS:
        wrap(module, attr, phase)
    from mmcache import featstore
    from mmcache.precompute.cli import main as cli_main

    code = os.path.realpath(featstore.__file__)
    sys.argv = ["mmcache", *argv]
    status = 0
    try:
        cli_main()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        Path(marks_path).write_text(json.dumps({"begin": t_begin, "end": _time.perf_counter(), "spans": spans, "code": code,
                                                "status": status}))
    sys.exit(status)


# ---- the parent -----------------------------------------------------------------------------------
def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def tree_of(spec: str, made: list[Path]) -> tuple[str, Path]:
    """(label, tree): ``.`` is this checkout; a commit gets a worktree /tmp/wt-<sha> (made once)."""
    if spec == ".":
        return "checkout", REPO
    sha = git("rev-parse", "--verify", f"{spec}^{{commit}}")
    where = Path(tempfile.gettempdir()) / f"wt-{sha[:12]}"
    if not (where / ".git").exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), sha], check=True, capture_output=True)
        made.append(where)
    return sha[:12], where


def package_root(tree: Path, where: Path) -> Path:
    """A folder whose mmcache links to ``tree`` (its root is the package: it has __init__.py), or
    whose mmcache/ links to the tree's three packages (trees from before that)."""
    where.mkdir(parents=True, exist_ok=True)
    link = where / "mmcache"
    if (tree / "__init__.py").exists():
        link.symlink_to(tree)
    else:
        link.mkdir()
        for name in PACKAGES:
            (link / name).symlink_to(tree / name)
    return where


def run_child(root: Path, tree: Path, argv: list[str], env: dict[str, str], marks: Path) -> dict:
    script = str(Path(__file__).resolve())
    paths = [str(root), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    code = (f"import sys; sys.path[:0] = {paths!r}; sys.argv = {[script, '--child', str(marks), *argv]!r}; __file__ = {script!r}; "
            "exec(compile(open(__file__).read(), __file__, 'exec'))")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=False,
                          env={**env, "PYTHONPATH": ""}, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t0
    if done.returncode or not marks.exists():
        raise SystemExit(f"child {argv} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    got = json.loads(marks.read_text())
    marks.unlink()
    if not got["code"].startswith(str(tree.resolve()) + os.sep):
        raise SystemExit(f"child imported {got['code']}, not the tree under {tree}")
    got["wall"], got["t0"], got["stdout"], got["stderr"] = wall, t0, done.stdout, done.stderr
    return got


def kind_of(req, prefix: str) -> str:
    """``METHOD what``: what the request touched, relative to the store's root ``prefix``."""
    key, method = req.key, req.method
    if not key:
        query = dict(p.partition("=")[::2] for p in req.query.split("&") if p)
        if "list-type" in query or "prefix" in query or (method == "GET" and not query.get("uploads")):
            listed = query.get("prefix", "")
            listed = listed[len(prefix):] if listed.startswith(prefix) else listed
            listed = re.sub(r"^(shards|index|rejects|checkpoints|declarations|prompts)/.+", r"\1/<x>", listed)
            return f"LIST {listed or '<root>'}" + (" (delim)" if query.get("delimiter") else "")
        return f"{method} <bucket>"
    if key.startswith(prefix):
        key = key[len(prefix):]
    elif key + "/" == prefix:
        return f"{method} <store root>"
    if key == "zarr.json":
        what = "zarr.json"
    elif key.startswith("index/_checkpoint"):
        what = "index/_checkpoint marker"
    elif key.startswith("index/"):
        what = "index/ part"
    elif key == "shards/zarr.json":
        what = "shards/zarr.json"
    elif key.startswith("shards/"):
        what = "shards/ data"
    elif key.startswith(("checkpoints/", "declarations/", "rejects/", "prompts/")):
        what = key.split("/", 1)[0] + "/"
    else:
        what = "other:" + key.split("/", 1)[0]
    if "uploadId" in req.query or "uploads" in req.query:
        what += " (multipart)"
    if req.if_none_match:
        what += " (if-none-match)"
    return f"{method} {what}"


def spans_of(marks: dict) -> list[tuple[str, float, float]]:
    """The child's finished spans, less index checkpoints inside the tasks' span (a writer's own
    compaction check of the client's plan-rejects commit: part of the tasks)."""
    spans = [(s[0], s[1], s[2]) for s in marks["spans"] if s[2] is not None]
    tasks = [s for s in spans if s[0] == "tasks"]
    return [s for s in spans if not (s[0] == "index checkpoint" and any(t[1] <= s[1] <= t[2] for t in tasks))]


def phase_of(start: float, marks: dict) -> str:
    spans = spans_of(marks)
    inside = [s for s in spans if s[1] <= start <= s[2]]
    if inside:
        name = max(inside, key=lambda s: s[1])[0]
        if name != "job":
            return name
        first = [s[1] for s in spans if s[0] in ("plan", "tasks")]
        last = max((s[2] for s in spans if s[0] != "job"), default=float("inf"))
        return "start" if not first or start < min(first) else "close" if start > last else "end other"
    jobs = [s for s in spans if s[0] == "job"]
    return "exit" if jobs and start > jobs[0][2] else "cli"


def phase_seconds(marks: dict) -> dict[str, float]:
    """Seconds per phase, each less the phases inside it (as phase_of counts requests)."""
    spans = spans_of(marks)
    jobs = [s for s in spans if s[0] == "job"]
    if not jobs:
        return {}
    job = jobs[0]
    out: Counter[str] = Counter({"cli": job[1] - marks["begin"], "exit": marks["end"] - job[2]})
    for span in spans:
        inner = [s for s in spans if s is not span and span[1] <= s[1] and s[2] <= span[2]]
        # the direct children: inside ``span`` and inside no other span inside it
        direct = [s for s in inner if not any(o is not s and o[1] <= s[1] and s[2] <= o[2] for o in inner)]
        own = (span[2] - span[1]) - sum(s[2] - s[1] for s in direct)
        if span[0] == "job":
            first = min((s[1] for s in spans if s[0] in ("plan", "tasks")), default=job[2])
            last = max((s[2] for s in spans if s[0] != "job"), default=job[2])
            within = sum(s[2] - s[1] for s in spans if s[0].startswith("start:") and job[1] <= s[1] and s[2] <= first)
            out["start"] += first - job[1] - within
            out["close"] += job[2] - last
            out["end other"] += own - (first - job[1] - within) - (job[2] - last)
        else:
            out[span[0]] += own
    return dict(out)


def measure(specs: list[str], reps: int, images: int, videos: int, keep: bool, dump_requests: bool = False,
            latency: float = 0.0) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.s3_server import S3ServerProcess, rounds  # the tests' server, from this checkout

    made: list[Path] = []
    work = Path(tempfile.mkdtemp(prefix="s3enc-"))
    server = S3ServerProcess()
    try:
        env = {**os.environ, **server.env()}
        manifest = make_data(work, images, videos)
        trees = []
        for spec in specs:
            label, tree = tree_of(spec, made)
            trees.append((label, tree, package_root(tree, work / f"root-{label}")))
        print(f"{images + videos} samples; trees: {', '.join(f'{label} ({tree})' for label, tree, _ in trees)}", flush=True)
        results: dict = {label: {"local": [], "s3": []} for label, _, _ in trees}
        base = ["encode", "--config", "tiny", "--workers", "2", "--set", "run.samples_per_task=8", "--input", str(manifest), "--no-progress"]
        # One unmeasured run per tree: the page cache holds its imports and the encoders' files.
        for label, tree, root in trees:
            run_child(root, tree, [*base, "--output", str(work / f"warm-{label}")], env, work / "marks.json")
        for rep in range(reps):
            for label, tree, root in trees:
                for dest in ("local", "s3"):
                    if dest == "local":
                        url = str(work / f"out-{label}-{rep}")
                        got = run_child(root, tree, [*base, "--output", url], env, work / "marks.json")
                        requests: list = []
                    else:
                        bucket = server.make_bucket("enc")
                        url = f"{bucket}/store"
                        with server.slowed(latency), server.recording() as requests:
                            got = run_child(root, tree, [*base, "--output", url], env, work / "marks.json")
                    prefix = url.removeprefix("s3://").partition("/")[2] + "/"
                    kinds: Counter[tuple[str, str]] = Counter()
                    by_phase: dict[str, list] = {}
                    dump = []
                    for req in requests:
                        phase, kind = phase_of(req.start, got), kind_of(req, prefix)
                        kinds[(phase, kind)] += 1
                        by_phase.setdefault(phase, []).append(req)
                        dump.append((phase, kind, req.key.removeprefix(prefix), req.query, round(req.start - got["begin"], 4),
                                     round(req.end - req.start, 4)))
                    job = next((s[3] for s in got["spans"] if s[0] == "job" and len(s) > 3), {})
                    run = {"wall": got["wall"], "job": job, "phases": phase_seconds(got), "requests": len(requests),
                           "kinds": {f"{p}|{k}": n for (p, k), n in kinds.items()},
                           "rounds": {p: rounds(reqs) for p, reqs in by_phase.items()},
                           "server_s": {p: sum(r.end - r.start for r in reqs) for p, reqs in by_phase.items()}}
                    if dump_requests:
                        run["dump"] = dump
                    if dest == "local":
                        shutil.rmtree(url, ignore_errors=True)
                    results[label][dest].append(run)
                    print(f"  rep {rep} {label} {dest:5s}: {got['wall']:6.2f} s wall, job {job.get('seconds') or 0:5.2f} s + start-up "
                          f"{job.get('startup') or 0:5.2f} s, {job.get('samples')} samples, {len(requests)} requests", flush=True)
        return {"trees": [(label, str(tree)) for label, tree, _ in trees], "results": results}
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        if not keep:
            for where in made:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)], check=False)


def make_data(work: Path, images: int, videos: int) -> Path:
    from mmcache.precompute.demo_data import make_dataset

    return make_dataset(work / "data", num_images=images, num_videos=videos)


def report(out: dict, shards: int) -> None:
    results = out["results"]
    print("\ntime = wall seconds of the whole command; ratio = time local / time s3")
    print(f"{'tree':14s} {'local best':>10s} {'median':>7s} {'s3 best':>8s} {'median':>7s} {'ratio best':>10s} {'median':>7s}   local runs / s3 runs")
    for label, runs in results.items():
        loc, s3 = [r["wall"] for r in runs["local"]], [r["wall"] for r in runs["s3"]]
        print(f"{label:14s} {min(loc):10.2f} {statistics.median(loc):7.2f} {min(s3):8.2f} {statistics.median(s3):7.2f} "
              f"{min(loc) / min(s3):10.2f} {statistics.median(loc) / statistics.median(s3):7.2f}   "
              f"{' '.join(f'{x:.2f}' for x in loc)} / {' '.join(f'{x:.2f}' for x in s3)}")
    print("\nthe job after its encoders are ready (EncodeSummary.seconds: planning, tasks, the end of the job; start-up excluded)")
    print(f"{'tree':14s} {'local best':>10s} {'median':>7s} {'s3 best':>8s} {'median':>7s} {'ratio best':>10s} {'median':>7s} {'s3-local med':>12s}")
    for label, runs in results.items():
        loc = [r["job"].get("seconds") or 0.0 for r in runs["local"]]
        s3 = [r["job"].get("seconds") or 0.0 for r in runs["s3"]]
        print(f"{label:14s} {min(loc):10.2f} {statistics.median(loc):7.2f} {min(s3):8.2f} {statistics.median(s3):7.2f} "
              f"{min(loc) / min(s3):10.2f} {statistics.median(loc) / statistics.median(s3):7.2f} {statistics.median(s3) - statistics.median(loc):12.2f}")
    print("\nphase seconds, median (local | s3)")
    print(f"{'tree':14s} " + " ".join(f"{p[:12]:>15s}" for p in PHASES))
    for label, runs in results.items():
        cells = []
        for phase in PHASES:
            lo = statistics.median(r["phases"].get(phase, 0.0) for r in runs["local"])
            hi = statistics.median(r["phases"].get(phase, 0.0) for r in runs["s3"])
            cells.append(f"{lo:6.2f} | {hi:6.2f}")
        print(f"{label:14s} " + " ".join(f"{c:>15s}" for c in cells))
    labels = list(results)
    print(f"\nS3 requests per job by phase and kind (median of the s3 runs; per shard = / {shards} shards)")
    table: dict[str, dict[str, float]] = {}
    for label in labels:
        keys = {k for r in results[label]["s3"] for k in r["kinds"]}
        table[label] = {k: statistics.median(r["kinds"].get(k, 0) for r in results[label]["s3"]) for k in keys}
    every = sorted({k for t in table.values() for k in t}, key=lambda k: (PHASES.index(k.split("|")[0]), k))
    print(f"{'phase':17s} {'kind':44s} " + " ".join(f"{label:>14s}" for label in labels))
    for phase in PHASES:
        rows = [k for k in every if k.split("|")[0] == phase]
        if not rows:
            continue
        for k in rows:
            print(f"{phase:17s} {k.split('|')[1]:44s} " + " ".join(f"{table[label].get(k, 0):14g}" for label in labels))
        print(f"{phase:17s} {'= all of the phase':44s} " + " ".join(f"{sum(v for kk, v in table[label].items() if kk.split('|')[0] == phase):14g}" for label in labels))
    print(f"{'job':17s} {'= all':44s} " + " ".join(f"{sum(table[label].values()):14g}" for label in labels))
    print(f"{'job':17s} {'= per shard':44s} " + " ".join(f"{sum(table[label].values()) / shards:14.1f}" for label in labels))
    tasks = {label: sum(v for k, v in table[label].items() if k.startswith("tasks|")) for label in labels}
    print(f"{'tasks':17s} {'= per shard':44s} " + " ".join(f"{tasks[label] / shards:14.1f}" for label in labels))
    print("\nround trips per phase (stretches with a request in flight; what a farther store pays per answer's latency),"
          " and seconds the server spent answering them (summed), median of the s3 runs")
    print(f"{'phase':17s} " + " ".join(f"{label + ' rounds':>20s} {'server s':>9s}" for label in labels))
    for phase in PHASES:
        cells = [(statistics.median(r["rounds"].get(phase, 0) for r in results[label]["s3"]),
                  statistics.median(r["server_s"].get(phase, 0.0) for r in results[label]["s3"])) for label in labels]
        if any(c[0] for c in cells):
            print(f"{phase:17s} " + " ".join(f"{a:20g} {b:9.2f}" for a, b in cells))
    print("\nby kind over the whole job")
    kinds = sorted({k.split("|")[1] for k in every})
    for kind in kinds:
        print(f"{'':17s} {kind:44s} " + " ".join(f"{sum(v for k, v in table[label].items() if k.split('|')[1] == kind):14g}" for label in labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="HEAD", help="commits (or '.', this checkout), comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--images", type=int, default=91)
    parser.add_argument("--videos", type=int, default=8)
    parser.add_argument("--json", default=None, help="write every run's figures here")
    parser.add_argument("--keep-worktrees", action="store_true")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to every S3 answer (a farther store; default 0)")
    parser.add_argument("--dump-requests", action="store_true", help="every request of every s3 run into --json")
    args = parser.parse_args()
    out = measure([t for t in args.trees.split(",") if t], args.reps, args.images, args.videos, args.keep_worktrees, args.dump_requests,
                  args.latency)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    report(out, shards=-(-(args.images + args.videos) // 8))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
    else:
        main()
