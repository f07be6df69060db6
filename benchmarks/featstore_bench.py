"""Benchmark the feature store against two baselines on the same disk, in one run (by hand, not a test).

    python benchmarks/featstore_bench.py [--gb 2.0] [--small 20000] [--dir /tmp] [--profile OP,...]
    python benchmarks/featstore_bench.py --open [--open-shards 2000] [--open-s3-shards 50,200]

Workloads (random bits with the top exponent bit cleared, so no inf/NaN; incompressible):
  A  MB-sized samples: bf16 video latents 16xTxHxW (T 5-21, H 30-60, W 40-80) + fp16 text
     embeddings Lx4096 (L 8-300); about --gb GB of payload (~2.4 MB per sample).
  B  small samples: fp16 text embeddings Lx1024 with L 12-20 (~32 KB), --small of them.

Baselines:
  (a) raw   the floor: for each store shard, one file holding the same samples' bytes back to
            back (same grouping, same bytes per shard as the store), written with plain
            open().write() of each array's buffer, fsynced per file; read back fully.
  (a1) seq  for the warm full scan: one file holding all of (a)'s bytes (fsynced: clean pages,
            as the store's are), read sequentially in 16 MiB pieces into one reused buffer (a
            copy out of the page cache, nothing else), against Store.scan() of every sample,
            CRC-checked, both with the page cache warm. CPU seconds of both are logged too.
  (b) torch one torch.save file per sample (dict of tensors, bf16 as torch.bfloat16) plus a JSONL
            list (the Open-Sora / MindSpeed-MM layout), fsynced per file; torch.load(weights_only=True).

Durability is the same for all three: the store fsyncs every object it writes, the raw baseline
every shard file, the torch baseline every sample file and the list. Write times run from the
first byte to the last fsync/close. Before every write and every cold read pass, os.sync() and
posix_fadvise(DONTNEED) on every file of the benchmark drop them all from the page cache; warm
passes repeat the same reads at once. (On a VM the host may still cache the virtual disk; "cold"
means cold in this guest.) Each measurement runs --repeat times, interleaved store/raw/torch with
the first two alternating, and the best time counts (other load on the machine only adds time);
the log lines show every pass. The last write pass runs store, raw, torch in that order, so the
baselines' files are the freshest: any host-cache bias is against the store.
The torch.save write runs once (20k fsynced files take 15-60 s here), and on workload B so do its
read passes (~15-25 s each; its margin over the target is wide).
MB = 10^6 bytes of payload (the samples' array bytes), whatever the layout writes on top.

--profile write-a,scan-a,random-a,write-b,scan-b,random-b re-runs those store operations (cold)
under cProfile after the table and prints their top functions.

--open runs only the open section: a store of --open-shards small shards opened from its index
parts, then from an index checkpoint (`mmcache compact`), then with 64 parts committed after
it; and, on S3 (moto over HTTP), the requests one open makes at each of --open-s3-shards,
counted at a loopback proxy.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from mmcache import featstore  # noqa: E402
from mmcache.featstore.writer import DEFAULT_SHARD_BYTES  # noqa: E402

MB = 1e6
SEED = 1234


# ---- data ---------------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    fields: dict
    samples: list  # [(id, {field: np.ndarray})]
    payload: int = 0
    # filled while running
    rows: list = field(default_factory=list)


def _bits(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    a = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    a &= 0xBFFF  # exponent MSB cleared: |x| < 2 for bf16 and fp16, never inf or NaN
    return a.view(dtype)


def make_workload_a(gb: float, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    samples, total = [], 0
    while total < gb * 1e9:
        t, h, w = int(rng.integers(5, 22)), int(rng.integers(30, 61)), int(rng.integers(40, 81))
        length = int(rng.integers(8, 301))
        arrays = {"latent": _bits(rng, (16, t, h, w), ml_dtypes.bfloat16), "text": _bits(rng, (length, 4096), np.float16)}
        samples.append((f"vid-{len(samples):07d}", arrays))
        total += sum(a.nbytes for a in arrays.values())
    fields = {"latent": {"dtype": "bfloat16", "ndim": 4}, "text": {"dtype": "float16", "ndim": 2}}
    return Workload("A", fields, samples, total)


def make_workload_b(count: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed + 1)
    samples, total = [], 0
    for i in range(count):
        arrays = {"text": _bits(rng, (int(rng.integers(12, 21)), 1024), np.float16)}
        samples.append((f"txt-{i:07d}", arrays))
        total += arrays["text"].nbytes
    return Workload("B", {"text": {"dtype": "float16", "ndim": 2}}, samples, total)


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# ---- file helpers -------------------------------------------------------------------------------
def files_under(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, names in os.walk(root) for f in names]


def evict(*roots: Path) -> None:
    """Drop every file under ``roots`` from the page cache.

    Every writer here has already fsynced each file it wrote; ``os.sync()`` makes sure no page is
    dirty (DONTNEED skips dirty pages). A per-file fsync here would cost a device cache flush
    (~1.5-3 ms) per file on this disk for nothing: 20k torch files make that a minute."""
    os.sync()
    for root in roots:
        for path in files_under(root):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_bytes(root: Path) -> tuple[int, int]:
    """(sum of file sizes, allocated bytes) under root."""
    size = alloc = 0
    for path in files_under(root):
        st = path.stat()
        size += st.st_size
        alloc += st.st_blocks * 512
    return size, alloc


def sample_nbytes(arrays: dict) -> int:
    return sum(a.nbytes for a in arrays.values())


# ---- the three layouts --------------------------------------------------------------------------
def shard_groups(samples: list, shard_bytes: int) -> list[list]:
    """The writer's own rule: a shard is cut as soon as it holds >= shard_bytes."""
    groups, cur, cur_bytes = [], [], 0
    for item in samples:
        cur.append(item)
        cur_bytes += sample_nbytes(item[1])
        if cur_bytes >= shard_bytes:
            groups.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        groups.append(cur)
    return groups


def store_write(wl: Workload, root: Path, shard_bytes: int) -> float:
    t0 = time.perf_counter()
    writer = featstore.create(str(root), fields=wl.fields, shard_bytes=shard_bytes)
    for sample_id, arrays in wl.samples:
        writer.add(sample_id, arrays)
    writer.close()
    return time.perf_counter() - t0


def raw_write(wl: Workload, root: Path, shard_bytes: int) -> tuple[float, dict, list]:
    """Returns (seconds, {id: (file, offset, nbytes)}, [shard sizes])."""
    t0 = time.perf_counter()
    root.mkdir(parents=True)
    where, sizes = {}, []
    for gi, group in enumerate(shard_groups(wl.samples, shard_bytes)):
        path = root / f"shard-{gi:06d}.bin"
        pos = 0
        with open(path, "wb") as fh:
            for sample_id, arrays in group:
                n = sample_nbytes(arrays)
                for a in arrays.values():
                    fh.write(a.reshape(-1).view(np.uint8))
                where[sample_id] = (path, pos, n)
                pos += n
            fh.flush()
            os.fsync(fh.fileno())
        sizes.append(pos)
    return time.perf_counter() - t0, where, sizes


def torch_write(wl: Workload, root: Path) -> float:
    t0 = time.perf_counter()
    (root / "samples").mkdir(parents=True)
    lines = []
    for sample_id, arrays in wl.samples:
        rel = f"samples/{sample_id}.pt"
        with open(root / rel, "wb") as fh:
            torch.save({k: to_torch(v) for k, v in arrays.items()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        lines.append(json.dumps({"id": sample_id, "path": rel}))
    with open(root / "list.jsonl", "w") as fh:
        fh.write("\n".join(lines) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def torch_list(root: Path) -> dict:
    with open(root / "list.jsonl") as fh:
        return {row["id"]: root / row["path"] for row in map(json.loads, fh)}


def store_scan(root: Path) -> tuple[float, int, int]:
    """``Store.scan()`` as a user runs it: every sample, CRC-checked, with its default read-ahead."""
    t0 = time.perf_counter()
    store = featstore.open(str(root))
    n = nbytes = 0
    for _sid, sample in store.scan():
        n += 1
        nbytes += sample_nbytes(sample)
    store.close()
    return time.perf_counter() - t0, n, nbytes


SEQ_PIECE = 16 << 20


def raw_one_file(raw_root: Path, path: Path) -> None:
    """The warm-scan baseline's file: every raw shard file's bytes back to back in one file,
    fsynced, so that its pages are clean, as the store's are, and no writeback of them runs
    beside the warm passes (it would take CPU from the store's checksum threads)."""
    with open(path, "wb") as out:
        for shard in sorted(raw_root.iterdir()):
            with open(shard, "rb") as fh:
                shutil.copyfileobj(fh, out, SEQ_PIECE)
        out.flush()
        os.fsync(out.fileno())


def raw_sequential(path: Path) -> tuple[float, int]:
    """One sequential read of a file through one reused buffer: a memory copy out of the page
    cache and nothing else (no checks, no allocation), the floor for a warm scan."""
    buf = np.empty(SEQ_PIECE, dtype=np.uint8)
    t0 = time.perf_counter()
    nbytes = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while got := os.preadv(fd, [buf], nbytes):
            nbytes += got
    finally:
        os.close(fd)
    return time.perf_counter() - t0, nbytes


def raw_scan(root: Path) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    nbytes = 0
    for path in sorted(root.iterdir()):
        with open(path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            buf = np.empty(size, dtype=np.uint8)
            view, pos = memoryview(buf), 0
            while pos < size:
                got = fh.readinto(view[pos:])
                if not got:
                    raise OSError(f"{path}: short read")
                pos += got
        nbytes += size
    return time.perf_counter() - t0, -1, nbytes


def torch_scan(root: Path) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    n = nbytes = 0
    for path in torch_list(root).values():
        sample = torch.load(path, weights_only=True)
        n += 1
        nbytes += sum(t.numel() * t.element_size() for t in sample.values())
    return time.perf_counter() - t0, n, nbytes


def store_random(store, order: list) -> tuple[float, int]:
    nbytes = 0
    t0 = time.perf_counter()
    for sample_id in order:
        nbytes += sample_nbytes(store.read(sample_id))
    return time.perf_counter() - t0, nbytes


def raw_random(fds: dict, where: dict, order: list) -> tuple[float, int]:
    nbytes = 0
    t0 = time.perf_counter()
    for sample_id in order:
        path, off, n = where[sample_id]
        buf = np.empty(n, dtype=np.uint8)
        if os.preadv(fds[path], [buf], off) != n:
            raise OSError("short read")
        nbytes += n
    return time.perf_counter() - t0, nbytes


def torch_random(paths: dict, order: list) -> tuple[float, int]:
    nbytes = 0
    t0 = time.perf_counter()
    for sample_id in order:
        sample = torch.load(paths[sample_id], weights_only=True)
        nbytes += sum(t.numel() * t.element_size() for t in sample.values())
    return time.perf_counter() - t0, nbytes


# ---- one workload -------------------------------------------------------------------------------
@dataclass
class Row:
    metric: str
    store: str
    raw: str
    torch: str
    ratio: float | None = None  # store / baseline (or store bytes / payload)
    basis: str = ""
    target: str = ""
    ok: bool | None = None


def _mbs(nbytes: float, secs: float) -> str:
    return f"{nbytes / MB / secs:,.0f} MB/s"


def _rate(n: int, nbytes: int, secs: float) -> str:
    return f"{n / secs:,.0f}/s {nbytes / MB / secs:,.0f}MB/s"


def run_workload(wl: Workload, base: Path, shard_bytes: int, random_target: float, reps: int, torch_reps: int, log) -> list[Row]:
    """Every measurement runs ``reps`` times (torch.save: ``torch_reps``; its write once),
    interleaved store / raw / torch, and the best (shortest) time counts: other load on the
    machine only ever adds time."""
    st_dir, raw_dir, pt_dir = base / f"{wl.name}-store", base / f"{wl.name}-raw", base / f"{wl.name}-torch"
    rows: list[Row] = []
    n, payload = len(wl.samples), wl.payload
    times: dict[str, list[float]] = {}

    def note(key: str, secs: float) -> None:
        times.setdefault(key, []).append(secs)

    def show(label: str, *keys: str) -> None:
        log(f"  {label:<13} " + "  ".join(f"{k.split('.')[-1]} " + "/".join(f"{t:.2f}" for t in times[k]) + "s" for k in keys if k in times))

    def rotated(r: int, jobs: list) -> list:
        # Alternate who goes first; the last pass always runs store, raw, torch in that order, so
        # the baselines' files are the most recently written (and most likely still in a host
        # cache beneath this VM): any such bias is against the store.
        return jobs if (reps - 1 - r) % 2 == 0 else jobs[1::-1] + jobs[2:]

    state: dict = {}

    # -- writes; each starts with every benchmark file out of the page cache
    def w_store() -> None:
        shutil.rmtree(st_dir, ignore_errors=True)
        evict(base)
        gc.collect()
        note("write.store", store_write(wl, st_dir, shard_bytes))

    def w_raw() -> None:
        shutil.rmtree(raw_dir, ignore_errors=True)
        evict(base)
        gc.collect()
        secs, state["where"], state["raw_sizes"] = raw_write(wl, raw_dir, shard_bytes)
        note("write.raw", secs)

    def w_torch() -> None:
        evict(base)
        gc.collect()
        note("write.torch", torch_write(wl, pt_dir))

    for r in range(reps):
        for job in rotated(r, [w_store, w_raw] + ([w_torch] if r == reps - 1 else [])):
            job()
    show("write", "write.store", "write.raw", "write.torch")
    where = state["where"]

    store = featstore.open(str(st_dir))
    counts = [info.num_samples for info in store.shards.values()]
    store.close()
    if counts != [len(g) for g in shard_groups(wl.samples, shard_bytes)]:
        raise AssertionError(f"raw baseline grouping ({len(state['raw_sizes'])} shards) differs from the store's {counts}")

    # -- full scans, cold
    def s_store() -> None:
        evict(base)
        secs, got_n, got_b = store_scan(st_dir)
        assert got_n == n and got_b == payload, (got_n, got_b)
        note("scan.store", secs)

    def s_raw() -> None:
        evict(base)
        secs, _, got_b = raw_scan(raw_dir)
        assert got_b == payload
        note("scan.raw", secs)

    def s_torch() -> None:
        evict(base)
        secs, got_n, got_b = torch_scan(pt_dir)
        assert got_n == n and got_b == payload
        note("scan.torch", secs)

    for r in range(reps):
        for job in rotated(r, [s_store, s_raw] + ([s_torch] if r >= reps - torch_reps else [])):
            job()
    show("scan cold", "scan.store", "scan.raw", "scan.torch")

    # -- full scans, page cache warm: the store's scan vs one sequential read of the same bytes
    one_file = base / f"{wl.name}-raw-one.bin"
    raw_one_file(raw_dir, one_file)

    # CPU seconds too (all threads): the store's checks run on several threads and the raw read
    # on one, so on a shared machine the wall-clock ratio depends on whether a core is free.
    def ws_store() -> None:
        cpu = time.process_time()
        secs, got_n, got_b = store_scan(st_dir)
        note("wcpu.store", time.process_time() - cpu)
        assert got_n == n and got_b == payload, (got_n, got_b)
        note("wscan.store", secs)

    def ws_raw() -> None:
        cpu = time.process_time()
        secs, got_b = raw_sequential(one_file)
        note("wcpu.raw", time.process_time() - cpu)
        assert got_b == payload
        note("wscan.raw", secs)

    ws_store(), ws_raw()  # warm the page cache (and the first pass's imports); not counted
    for key in ("wscan.store", "wscan.raw", "wcpu.store", "wcpu.raw"):
        times.pop(key)
    for r in range(reps):
        for job in rotated(r, [ws_store, ws_raw]):
            job()
    show("scan warm", "wscan.store", "wscan.raw")
    show("  (CPU s)", "wcpu.store", "wcpu.raw")
    one_file.unlink()

    # -- random reads, cold then warm at once, the same shuffled order for all three
    order = [sid for sid, _ in wl.samples]
    np.random.default_rng(SEED).shuffle(order)

    def r_store() -> None:
        evict(base)
        t0 = time.perf_counter()
        store = featstore.open(str(st_dir))
        note("open.store", time.perf_counter() - t0)
        secs, b1 = store_random(store, order)
        note("cold.store", secs)
        secs, b2 = store_random(store, order)
        note("warm.store", secs)
        store.close()
        assert b1 == b2 == payload

    def r_raw() -> None:
        evict(base)
        fds = {path: os.open(path, os.O_RDONLY) for path in sorted(raw_dir.iterdir())}
        note("cold.raw", raw_random(fds, where, order)[0])
        note("warm.raw", raw_random(fds, where, order)[0])
        for fd in fds.values():
            os.close(fd)

    def r_torch() -> None:
        evict(base)
        t0 = time.perf_counter()
        paths = torch_list(pt_dir)
        note("open.torch", time.perf_counter() - t0)
        secs, b3 = torch_random(paths, order)
        assert b3 == payload
        note("cold.torch", secs)
        note("warm.torch", torch_random(paths, order)[0])

    for r in range(reps):
        for job in rotated(r, [r_store, r_raw] + ([r_torch] if r >= reps - torch_reps else [])):
            job()
    show("random cold", "cold.store", "cold.raw", "cold.torch")
    show("random warm", "warm.store", "warm.raw", "warm.torch")
    show("open", "open.store", "open.torch")

    best = {k: min(v) for k, v in times.items()}
    ratio = best["write.raw"] / best["write.store"]
    rows.append(Row("write (incl. fsync)", _mbs(payload, best["write.store"]), _mbs(payload, best["write.raw"]), _mbs(payload, best["write.torch"]), ratio, "a", ">= 0.80", ratio >= 0.8))
    ratio = best["scan.raw"] / best["scan.store"]
    rows.append(Row("full scan, cold", _mbs(payload, best["scan.store"]), _mbs(payload, best["scan.raw"]), _mbs(payload, best["scan.torch"]), ratio, "a", ">= 0.80", ratio >= 0.8))
    ratio = best["wscan.raw"] / best["wscan.store"]
    # The goal is set for MB-sized samples; for small ones the figure is shown, per-sample
    # Python work (a view and a CRC call per sample) decides it.
    goal = wl.name == "A"
    rows.append(Row("full scan, warm", _rate(n, payload, best["wscan.store"]), _mbs(payload, best["wscan.raw"]) + " seq", "", ratio, "a1",
                    ">= 0.90" if goal else "", ratio >= 0.9 if goal else None))
    tgt = f">= {random_target:.2f}"
    for label, key in (("random read, cold", "cold"), ("random read, warm", "warm")):
        s, r_, t = best[f"{key}.store"], best[f"{key}.raw"], best[f"{key}.torch"]
        ratio = t / s
        rows.append(Row(label, _rate(n, payload, s), _rate(n, payload, r_), _rate(n, payload, t), ratio, "b", tgt, ratio >= random_target))

    # -- bytes on disk
    (s_size, s_alloc), (r_size, r_alloc), (t_size, t_alloc) = disk_bytes(st_dir), disk_bytes(raw_dir), disk_bytes(pt_dir)
    ratio = s_size / payload
    rows.append(Row("bytes on disk / payload", f"{s_size / payload:.4f}x", f"{r_size / payload:.4f}x", f"{t_size / payload:.4f}x", ratio, "payload", "<= 1.02", ratio <= 1.02))
    rows.append(Row("  (allocated blocks)", f"{s_alloc / payload:.4f}x", f"{r_alloc / payload:.4f}x", f"{t_alloc / payload:.4f}x"))
    rows.append(Row("  (files)", f"{len(files_under(st_dir)):,}", f"{len(files_under(raw_dir)):,}", f"{len(files_under(pt_dir)):,}"))

    for d in (st_dir, raw_dir, pt_dir):
        shutil.rmtree(d)
    return rows


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    head = f"{'metric':<26} {'store':>22} {'raw (a)':>22} {'torch.save (b)':>22} {'ratio':>12} {'target':>8}  result"
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = "" if r.ratio is None else (f"{r.ratio:.2f}x {r.basis}" if r.basis != "payload" else f"{r.ratio:.4f}")
        result = "" if r.ok is None else ("PASS" if r.ok else "FAIL")
        print(f"{r.metric:<26} {r.store:>22} {r.raw:>22} {r.torch:>22} {ratio:>12} {r.target:>8}  {result}")


# ---- profiling ----------------------------------------------------------------------------------
def profile_op(op: str, workloads: dict, base: Path, shard_bytes: int, top: int) -> None:
    kind, wname = op.rsplit("-", 1)
    wl = workloads[wname.upper()]
    root = base / f"profile-{op}"
    if kind != "write":
        store_write(wl, root, shard_bytes)
    evict(base)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    if kind == "write":
        prof.runcall(store_write, wl, root, shard_bytes)
    elif kind == "scan":
        prof.runcall(store_scan, root)
    elif kind == "random":
        order = [sid for sid, _ in wl.samples]
        np.random.default_rng(SEED).shuffle(order)
        store = featstore.open(str(root))
        prof.runcall(store_random, store, order)  # cold
        prof.runcall(store_random, store, order)  # warm
        store.close()
    else:
        raise SystemExit(f"unknown --profile op {op!r}")
    wall = time.perf_counter() - t0
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    print(f"\n==== cProfile: store {op} ({'cold + warm pass' if kind == 'random' else 'cold'}), {wall:.2f}s under the profiler; top {top} by tottime")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip() and not line.startswith(("   Ordered", "   List"))))
    shutil.rmtree(root)


# ---- open: index checkpoints ---------------------------------------------------------------------
def _tiny_store(url: str, shards: int, per_shard: int = 4, storage_options: dict | None = None) -> None:
    """``shards`` committed shards of ``per_shard`` small samples each (the index is what an open reads)."""
    rng = np.random.default_rng(SEED)
    with featstore.create(url, fields={"x": "float16"}, storage_options=storage_options, compact_every=0, shard_prefix="base") as writer:
        for s in range(shards):
            for j in range(per_shard):
                writer.add(f"s{s:06d}-{j}", {"x": rng.standard_normal((int(rng.integers(4, 32)), 8)).astype(np.float16)}, {"caption": f"sample {s}/{j}"})
            writer.commit()


def _open_times(url: str, reps: int) -> tuple[float, float, featstore.Store]:
    """Best wall and best CPU seconds of ``reps`` opens (CPU time: this machine is shared, and an
    open from the page cache is CPU-bound, so it shows the work with less of the others' load)."""
    wall, cpu, store = float("inf"), float("inf"), None
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        store = featstore.open(url)
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return wall, cpu, store


def _hidden(root: Path, hide: bool) -> None:
    """Hide (or show again) the checkpoint markers: a hidden one is a name readers skip, so the
    same store opens from its parts; toggling lets both kinds of open alternate under one load."""
    index = root / "index"
    for path in index.iterdir():
        if hide and path.name.startswith("_checkpoint."):
            path.rename(index / f".hidden{path.name}")
        elif not hide and path.name.startswith(".hidden_checkpoint."):
            path.rename(index / path.name.removeprefix(".hidden"))


def bench_open(base: Path, shards: int, s3_shards: list[int], reps: int, log, reuse: Path | None = None) -> None:
    """Open of a ``shards``-shard local store before and after `mmcache compact`, and the object
    reads (and listings) one open makes on S3 (moto over HTTP, counted at a loopback proxy) at
    each of ``s3_shards``, with a checkpoint plus two commits after it, and without one."""
    from mmcache.featstore.compact import compact_store

    root = reuse if reuse is not None else base / f"open-{shards}"
    if not (root / "zarr.json").exists():
        log(f"open: writing a {shards}-shard local store")
        t0 = time.perf_counter()
        _tiny_store(str(root), shards)
        log(f"open: written in {time.perf_counter() - t0:.1f}s")
    _hidden(root, True)
    for path in (root / "index").iterdir():  # a reused store: back to its first parts, no checkpoint
        if path.name.startswith(("late-", ".hidden_checkpoint.")):
            path.unlink()
    for path in (root / "shards").glob("late-*"):
        shutil.rmtree(path)
    shutil.rmtree(root / "checkpoints", ignore_errors=True)
    shards = sum(1 for p in (root / "index").iterdir() if p.name.endswith(".parquet"))
    t0 = time.perf_counter()
    summary = compact_store(featstore.open(str(root)).storage)
    compacted = time.perf_counter() - t0
    results: dict[str, list[tuple[float, float]]] = {"parts": [], "checkpoint": [], "tail": []}

    def alternate(label: str) -> None:
        # parts-only and checkpoint opens alternate, so that both see the same load
        for _ in range(reps):
            _hidden(root, True)
            results["parts"].append(_open_times(str(root), 1)[:2])
            _hidden(root, False)
            wall, cpu, store = _open_times(str(root), 3)
            assert store.checkpoint == summary.key
            results[label].append((wall, cpu))

    alternate("checkpoint")
    samples = len(featstore.open(str(root)))
    # The same store with 64 commits after the checkpoint (the most a writer leaves, K=64).
    with featstore.append(str(root), compact_every=0, shard_prefix="late") as writer:
        for s in range(64):
            writer.add(f"late{s}", {"x": np.zeros((4, 8), np.float16)})
            writer.commit()
    alternate("tail")
    best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in results.items()}
    (pw, pc), (cw, cc), (tw, tc) = best["parts"], best["checkpoint"], best["tail"]
    print(f"\nOpen of a {shards}-shard local store ({samples:,} samples; alternating, best of {reps} x 3; wall / CPU):")
    print(f"  index parts only        {pw * 1e3:8.1f} / {pc * 1e3:7.1f} ms")
    print(f"  from the checkpoint     {cw * 1e3:8.1f} / {cc * 1e3:7.1f} ms   ratio {pw / cw:5.1f}x / {pc / cc:5.1f}x faster "
          f"(goal: <= 50 ms, i.e. ~38x of the ~1.9 s measured unloaded)")
    print(f"  + 64 parts after it     {tw * 1e3:8.1f} / {tc * 1e3:7.1f} ms   ratio {pw / tw:5.1f}x / {pc / tc:5.1f}x")
    print(f"  compaction              {compacted * 1e3:8.1f} ms wall, checkpoint {summary.nbytes / 1e3:.0f} KB; load avg {os.getloadavg()[0]:.1f}")
    if not s3_shards:
        return
    from tests.s3_server import FaultProxy, S3Server

    server = S3Server()
    os.environ.update(server.env())
    bucket = server.make_bucket("bench")
    rows = []
    try:
        with FaultProxy((server.host, server.port), lifetime=3600) as proxy:
            seen: list[tuple[str, str]] = []
            proxy.rules.append(lambda method, path: seen.append((method, path)))  # records, never faults
            options = {"endpoint_url": proxy.endpoint, "skip_instance_cache": True}

            def counted_open(url: str) -> tuple[int, int, float]:
                secs = float("inf")
                for _ in range(max(reps, 3)):  # the requests of the last, the best time of all
                    seen.clear()
                    t0 = time.perf_counter()
                    featstore.open(url, options)
                    secs = min(secs, time.perf_counter() - t0)
                lists = sum(1 for method, path in seen if method == "GET" and "list-type=" in path)
                return len(seen) - lists, lists, secs

            for n in s3_shards:
                url = f"{bucket}/open-{n}"
                log(f"open: writing a {n}-shard store to S3")
                _tiny_store(url, n)  # straight to the server; only opens go through the proxy
                plain = counted_open(url)
                compact_store(featstore.open(url).storage)
                with featstore.append(url, compact_every=0) as writer:
                    for s in range(2):
                        writer.add(f"late{s}", {"x": np.zeros((4, 8), np.float16)})
                        writer.commit()
                rows.append((n, plain, counted_open(url)))
    finally:
        server.stop()
    print("\nRequests per open on S3 (moto over HTTP; object reads = every request but the listings):")
    print(f"  {'shards':>7}  {'reads, parts only':>18}  {'reads, checkpoint + 2 parts':>28}  {'listings':>9}  {'open s (parts / ckpt)':>22}")
    for n, plain, ckpt in rows:
        print(f"  {n:7d}  {plain[0]:18d}  {ckpt[0]:28d}  {ckpt[1]:9d}  {plain[2]:10.3f} / {ckpt[2]:.3f}")
    constant = len({ckpt[0] for _, _, ckpt in rows}) == 1
    print(f"  object reads per open with a checkpoint {'are constant' if constant else 'VARY'} in the shard count")


# ---- main ---------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="payload of workload A in GB (default 2.0)")
    ap.add_argument("--small", type=int, default=20_000, help="number of small samples in workload B (default 20000)")
    ap.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_BYTES / (1 << 20), help="store shard size in MiB (default: the writer's default)")
    ap.add_argument("--dir", default=None, help="parent directory for the benchmark's temp dir (default: system temp, /tmp)")
    ap.add_argument("--profile", default="", help="comma-separated store ops to re-run under cProfile: write-a,scan-a,random-a,write-b,scan-b,random-b")
    ap.add_argument("--top", type=int, default=25, help="functions to show per profile")
    ap.add_argument("--repeat", type=int, default=3, help="passes per measurement, best counts (default 3; torch.save: once on workload B, its write once)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--open", action="store_true", help="run only the open section: index parts vs an index checkpoint (mmcache compact)")
    ap.add_argument("--open-shards", type=int, default=2000, help="shards of the local store the open section opens (default 2000)")
    ap.add_argument("--open-store", default=None, help="the open section's local store: reused if there (its later commits and checkpoints dropped), written there if not")
    ap.add_argument("--open-s3-shards", default="50,200", help="comma-separated shard counts of the S3 stores whose requests per open are counted ('' skips S3)")
    args = ap.parse_args()
    shard_bytes = int(args.shard_mb * (1 << 20))

    base = Path(tempfile.mkdtemp(prefix="featstore-bench-", dir=args.dir))
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    if args.open:
        try:
            bench_open(base, args.open_shards, [int(n) for n in args.open_s3_shards.split(",") if n], args.repeat, log,
                       Path(args.open_store) if args.open_store else None)
        finally:
            if args.keep:
                print(f"kept {base}")
            else:
                shutil.rmtree(base, ignore_errors=True)
        return
    try:
        st = os.statvfs(base)
        print(f"featstore bench: python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
              f"{os.cpu_count()} CPUs (load avg {os.getloadavg()[0]:.1f}), dir {base} ({st.f_bavail * st.f_frsize / 1e9:.0f} GB free), shard {args.shard_mb:g} MiB")
        log("generating workload A")
        wa = make_workload_a(args.gb, SEED)
        log(f"workload A: {len(wa.samples):,} samples, {wa.payload / 1e9:.2f} GB, {wa.payload / len(wa.samples) / MB:.2f} MB/sample")
        rows_a = run_workload(wa, base, shard_bytes, 1.0, args.repeat, args.repeat, log)
        log("generating workload B")
        wb = make_workload_b(args.small, SEED)
        log(f"workload B: {len(wb.samples):,} samples, {wb.payload / 1e9:.2f} GB, {wb.payload / len(wb.samples) / 1e3:.1f} KB/sample")
        # torch.save passes over 20k small files take ~25 s each, and its margin is wide: once.
        rows_b = run_workload(wb, base, shard_bytes, 5.0, args.repeat, 1, log)

        nshards_a = len(shard_groups(wa.samples, shard_bytes))
        nshards_b = len(shard_groups(wb.samples, shard_bytes))
        print_table(f"Workload A: {len(wa.samples):,} MB-sized samples (bf16 latent + fp16 text), {wa.payload / 1e9:.2f} GB payload, {nshards_a} shards", rows_a)
        print_table(f"Workload B: {len(wb.samples):,} small samples (fp16 text, ~{wb.payload / len(wb.samples) / 1e3:.0f} KB), {wb.payload / 1e9:.2f} GB payload, {nshards_b} shards", rows_b)
        fails = [f"{w}: {r.metric}" for w, rows in (("A", rows_a), ("B", rows_b)) for r in rows if r.ok is False]
        print(f"\nratio = store/baseline throughput (a: raw floor, a1: one sequential read, b: torch.save), or store bytes / payload. "
              f"{'All targets met.' if not fails else 'FAIL: ' + '; '.join(fails)}")
        log(f"done (load avg {os.getloadavg()[0]:.1f}; other processes on this machine slow CPU-bound paths, hence best of --repeat)")

        for op in filter(None, (o.strip() for o in args.profile.split(","))):
            profile_op(op, {"A": wa, "B": wb}, base, shard_bytes, args.top)
    finally:
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
