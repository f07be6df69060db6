"""Every rank of a run trains on one snapshot of committed shards, even when an encode job
commits a new shard between the moments two ranks open the store (real S3 over HTTP, 2 gloo
processes)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from datetime import timedelta

from mmcache import featstore
from tests.featstore.conformance import FIELDS, ragged_samples


def _rank(rank: int, port: int, url: str, results) -> None:
    import torch.distributed as dist

    import mmcache.train.data.stream

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
        if rank == 1:
            real_open = featstore.open

            def commit_then_open(*args, **kwargs):
                # An encode job commits a shard after rank 0 took its snapshot, before rank 1 opens.
                with featstore.append(url, shard_prefix="late") as writer:
                    writer.add("late-0", ragged_samples(1, seed=9)[0][1])
                return real_open(*args, **kwargs)

            mmcache.train.data.stream.featstore.open = commit_then_open
        store = mmcache.train.data.stream.open_features(url, None)
        dist.barrier()
        results.put((rank, sorted(store.shards), len(store)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_ranks_agree_on_one_snapshot_of_a_growing_store(s3_bucket):
    url = f"{s3_bucket}/store"
    with featstore.create(url, fields=FIELDS, shard_bytes=2000) as writer:
        for sample_id, arrays, meta in ragged_samples(12):
            writer.add(sample_id, arrays, meta)
    committed = len(featstore.open(url).shards)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, url, results)) for r in range(2)]
    for p in procs:
        p.start()
    reports = dict((r, (a, b)) for r, a, b in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    for rank, (shards, _) in reports.items():
        assert isinstance(shards, list), f"rank {rank}:\n{shards}"
    assert reports[0] == reports[1]
    assert len(reports[0][0]) == committed and reports[0][1] == 12
    assert len(featstore.open(url).shards) == committed + 1  # the late shard exists; neither rank uses it
