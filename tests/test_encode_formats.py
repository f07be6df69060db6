"""`mmcache encode` on data as it ships, end to end on a real Dask LocalCluster with the default
tiny config: WebDataset tars (local and on S3 through the moto server), Parquet with image
bytes, a LLaVA JSON array; and a tar job killed mid-way and run again, exactly once."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import pytest

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.featstore.verify import store_info, verify_store
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.pipeline import run_encode
from tests.input_data import add_member, png, write_llava, write_media_parquet, write_tar
from tests.s3_server import FAKE_KEY_ID, FAKE_SECRET

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client

    from mmcache.precompute.runtime.local_cluster import local_cluster

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with local_cluster(2) as cluster, Client(cluster) as client:
        yield cluster.scheduler_address, client


def encode(inputs: list[str], out: str, cluster, preset: str = "tiny", overrides: list[str] | None = None, **kw):
    config = load_config(EncodeConfig, preset, "encode", overrides or [])
    kw.setdefault("log", lambda *_: None)
    kw.setdefault("progress", False)
    return run_encode(config, inputs, out, scheduler=cluster[0], **kw)


def by_id(store) -> dict[str, dict]:
    return {row["id"]: row for row in store.index.to_pylist()}


def test_tar_shards_locally_then_grown(tmp_path, cluster, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    # 20 samples in the first tar: two parts (the tiny preset's 16 samples per task, then 4).
    good = [f"{s:05d}:{k}" for s in range(2) for k in write_tar(shards / f"{s:05d}.tar", s, 20 - 15 * s, defects=s == 1)]
    (shards / "00000.parquet").write_bytes(b"img2dataset's metadata beside the tar")  # not selected: not an input
    (shards / "00000_stats.json").write_text("{}")
    out = str(tmp_path / "store")
    summary = encode([str(shards / "{00000..00001}.tar")], out, cluster, progress=True)
    # The progress total settles on what the tars held (planning reads no tar: it estimates them).
    last = capsys.readouterr().err.split("\r")[-1].split()[0]
    assert last == "32/32", last  # 26 samples and 6 rejects
    store = featstore.open(out)
    assert sorted(store.sample_ids()) == sorted(good) and summary.samples_written == len(good) == 26
    reasons = {r["id"]: r["reason"] for r in store.rejects.to_pylist()}
    assert "truncated or corrupt image" in reasons["00001:broken"] and "empty caption" in reasons["00001:nocaption"]
    assert "no media member" in reasons["00001:onlyjson"] and "leaves the tar's root" in reasons[next(i for i in reasons if "escape" in i)]
    assert "symbolic link" in reasons["00001:link"] and "character device" in reasons["00001:dev"] and len(reasons) == 6
    row = by_id(store)["00001:000100003"]
    assert row["source_uri"] == str(shards / "00001.tar") + "#000100003.png" and row["caption"] == "picture 000100003"
    assert json.loads(row["source_json"])["status"] == "success" and row["orig_width"] == 48 and row["content_hash"]
    assert by_id(store)["00001:jsoncap"]["caption"] == "from the sidecar"
    assert store_info(store)["samples_by_input"] == {str(shards / "00000.tar"): 20, str(shards / "00001.tar"): 6}
    again = encode([str(shards / "*.tar")], out, cluster)
    assert again.tasks == 0 and again.samples_written == 0
    write_tar(shards / "00002.tar", 2, 3)
    grown = encode([str(shards / "*.tar")], out, cluster)
    assert grown.tasks == 1 and grown.samples_written == 3 and len(featstore.open(out)) == 29
    # The shard is fixed upstream (the key without a caption gets one): retrying rejects re-reads
    # the tars and encodes just that member; committed members are not encoded again.
    with tarfile.open(shards / "00001.tar") as old:
        members = [(m, old.extractfile(m).read() if m.isreg() else b"") for m in old.getmembers()]
    with tarfile.open(shards / "00001.tar", "w") as archive:
        for member, data in members:
            archive.addfile(member, io.BytesIO(data) if member.isreg() else None)
            if member.name == "nocaption.json":
                add_member(archive, "nocaption.txt", b"a caption at last")
    retried = encode([str(shards / "*.tar")], out, cluster, overrides=["data.retry_rejects=true"])
    assert retried.samples_written == 1 and "00001:nocaption" in featstore.open(out)
    # A text field added to the samples of the tars: from their recorded captions, no tar read for it.
    lines: list[str] = []
    added = encode([str(shards / "*.tar")], out, cluster, overrides=["text.max_length=16", "text.field=text_short"], log=lines.append)
    assert added.samples_written == 30 and any("adding text_short to 30 sample(s) already in the store" in line for line in lines), lines
    assert featstore.open(out).samples_per_field()["text_short"] == 30


def test_tar_shards_from_s3(tmp_path, cluster, s3_server, s3_bucket):
    import fsspec

    from mmcache.precompute.inputs.registry import SourceOptions
    from mmcache.precompute.inputs.stream import read_all

    for shard in range(2):
        write_tar(tmp_path / f"{shard:05d}.tar", shard, 4)
    # Named, not from AWS_*: this module's cluster started before the S3 fixture set them.
    options = {"endpoint_url": s3_server.endpoint, "key": FAKE_KEY_ID, "secret": FAKE_SECRET}
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    fs.put([str(tmp_path / "00000.tar"), str(tmp_path / "00001.tar")], f"{s3_bucket}/shards/")
    fs.pipe(f"{s3_bucket}/shards/00000.parquet", b"not an input")
    write_media_parquet(tmp_path / "hf.parquet", [png(n) for n in range(3)], ["a", "b", "c"], row_group_size=2)
    fs.put(str(tmp_path / "hf.parquet"), f"{s3_bucket}/hf/train.parquet")
    pattern = f"{s3_bucket}/shards/{{00000..00001}}.tar"
    with s3_server.recording() as planning:
        units = read_all([pattern], SourceOptions(storage_options=options)).units
    assert len(units) == 2 and not [r for r in planning if r.key.endswith(".tar") and r.method == "GET"]
    out = f"{s3_bucket}/store"
    with s3_server.recording() as requests:
        summary = encode([pattern, f"{s3_bucket}/hf/train.parquet"], out, cluster, storage_options=options, input_storage_options=options)
    assert summary.samples_written == 11
    store = featstore.open(out, storage_options=options)
    expected = [f"{s:05d}:{s:04d}{k:05d}" for s in range(2) for k in range(4)] + [f"train:{n}" for n in range(3)]
    assert sorted(store.sample_ids()) == sorted(expected) and by_id(store)["train:2"]["caption"] == "c"
    assert by_id(store)["00000:000000002"]["source_uri"] == f"{s3_bucket}/shards/00000.tar#000000002.png"
    reads = [r for r in requests if r.key.endswith(".tar") and r.method == "GET"]
    assert len(reads) == 2, reads  # one sequential read per tar, not one per member
    # A visual field added later reads each member alone: one ranged GET of its header and data, no other request.
    with s3_server.recording() as requests:
        added = encode([pattern, f"{s3_bucket}/hf/train.parquet"], out, cluster, overrides=["vit.encoder=clip_vision", "vit.path=tiny"],
                       storage_options=options, input_storage_options=options)
    assert added.samples_written == 11 and featstore.open(out, storage_options=options).samples_per_field()["vit_features"] == 11
    sizes = {row["id"]: row["source_size"] for row in by_id(store).values() if row["source_size"]}
    reads = [r for r in requests if r.key.endswith(".tar")]
    assert len(reads) == 8 and {r.method for r in reads} == {"GET"} and sorted(r.nbytes for r in reads) == sorted(512 + size for size in sizes.values()), reads


def test_parquet_with_image_bytes(tmp_path, cluster):
    images = [png(n) for n in range(10)]
    images[3] = None
    images[6] = images[6][:25]  # undecodable
    write_media_parquet(tmp_path / "train-00000.parquet", images, [f"caption {n}" for n in range(10)], row_group_size=4)
    out = str(tmp_path / "store")
    summary = encode([str(tmp_path / "train-00000.parquet")], out, cluster)
    store = featstore.open(out)
    assert summary.samples_written == 8 and sorted(store.sample_ids()) == sorted(f"train-00000:{n}" for n in range(10) if n not in (3, 6))
    reasons = {r["id"]: r["reason"] for r in store.rejects.to_pylist()}
    assert reasons == {"train-00000:3": "null image", "train-00000:6": reasons["train-00000:6"]}
    assert "truncated or corrupt image" in reasons["train-00000:6"]
    row = by_id(store)["train-00000:7"]
    assert row["caption"] == "caption 7" and row["source_uri"].endswith("train-00000.parquet#7") and row["orig_width"] == 48
    assert encode([str(tmp_path / "train-00000.parquet")], out, cluster).tasks == 0


def test_a_field_added_to_samples_of_tars_and_parquet_equals_a_fresh_encode(tmp_path, cluster):
    """A field added to committed samples of tars (plain, gz) and Parquet reads each member again
    alone, from the inputs moved to another folder (the same inputs by file name); a member whose
    bytes changed since is a reject, not given a field from other bytes, and data.check_content
    reports it."""
    write_tar(tmp_path / "00000.tar", 0, 5)
    write_tar(tmp_path / "plain.tar", 1, 3)
    (tmp_path / "00001.tar.gz").write_bytes(gzip.compress((tmp_path / "plain.tar").read_bytes()))  # offsets in the decompressed tar
    write_media_parquet(tmp_path / "hf.parquet", [png(100 + n) for n in range(4)], [f"c {n}" for n in range(4)], row_group_size=3)
    # Ids of its own (no file stem in them): found by file name among the ids the client read of it.
    write_media_parquet(tmp_path / "named.parquet", [png(200 + n) for n in range(2)], ["n 0", "n 1"], ids=["cat-1", "dog-2"])
    names = ["00000.tar", "00001.tar.gz", "hf.parquet", "named.parquet"]
    out, fresh, with_vit = str(tmp_path / "store"), str(tmp_path / "fresh"), ["vit.encoder=clip_vision", "vit.path=tiny"]
    assert encode([str(tmp_path / n) for n in names], out, cluster).samples_written == 14
    row = by_id(featstore.open(out))["00000:000000002"]
    tar = (tmp_path / "00000.tar").read_bytes()
    assert hashlib.sha256(tar[row["source_offset"] : row["source_offset"] + row["source_size"]]).hexdigest() == row["content_hash"]
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in names[1:]:
        shutil.copy(tmp_path / name, moved / name)
    with tarfile.open(tmp_path / "00000.tar") as old, tarfile.open(moved / "00000.tar", "w") as archive:
        for member in old.getmembers():
            data = old.extractfile(member).read()
            archive.addfile(member, io.BytesIO(bytes(255 - b for b in data) if member.name == "000000003.png" else data))
    inputs = [str(moved / n) for n in names]
    lines: list[str] = []
    added = encode(inputs, out, cluster, overrides=with_vit, log=lines.append)
    # Rejected twice: the moved tar's task reads its members (a resume) and finds one with other
    # bytes than the committed sample's; the field's task refuses to add a field from them.
    assert added.samples_written == 13 and added.rejected == 2
    assert any("adding vit_features to 14 sample(s) already in the store" in line for line in lines), lines
    store = featstore.open(out)
    reasons = sorted(r["reason"] for r in store.rejects.to_pylist() if r["id"] == "00000:000000003")
    assert len(reasons) == 2 and "duplicate id" in reasons[0] and "input changed since its sample was encoded" in reasons[1], reasons
    encode([str(tmp_path / n) for n in names], fresh, cluster, overrides=with_vit)
    reference = featstore.open(fresh)
    assert store.samples_per_field() == {"latent": 14, "text_emb": 14, "vit_features": 13}
    for sid in reference.sample_ids():
        if sid != "00000:000000003":
            assert store.read(sid, ["vit_features"])["vit_features"].tobytes() == reference.read(sid, ["vit_features"])["vit_features"].tobytes()
    assert encode(inputs, out, cluster, overrides=with_vit).tasks == 0  # the changed member was rejected: not tried again
    # data.check_content re-reads each committed member alone: the rewritten one is reported.
    lines.clear()
    encode(inputs, out, cluster, overrides=[*with_vit, "data.check_content=true"], log=lines.append)
    assert any("1 committed sample(s) changed since they were encoded (1 content changed; e.g. '00000:000000003')" in line
               for line in lines), lines
    shutil.copy(tmp_path / "00000.tar", moved / "00000.tar")  # the input restored: a retry adds its field
    assert encode(inputs, out, cluster, overrides=[*with_vit, "data.retry_rejects=true"]).samples_written == 1
    assert featstore.open(out).samples_per_field()["vit_features"] == 14


def test_a_field_added_to_clips_is_made_from_each_clips_frames(tmp_path, cluster):
    """Clips of videos (``frames.clips``) in a tar and in a manifest get an added field from their
    own recorded frames: the same values as a fresh encode of every field; a re-run adds nothing."""
    from tests.test_media import write_gray_ramp_video

    video = write_gray_ramp_video(tmp_path / "ramp.mp4", frames=30, fps=24)
    with tarfile.open(tmp_path / "00000.tar", "w") as archive:
        for n in range(2):
            add_member(archive, f"v{n}.mp4", video)
            add_member(archive, f"v{n}.txt", f"gray ramp {n}".encode())
    # Listed twice: the second row is a reject (duplicate id), which must not hold back the first's clips.
    (tmp_path / "videos.jsonl").write_text(2 * (json.dumps({"id": "ramp", "path": "ramp.mp4", "caption": "a gray ramp"}) + "\n"))
    inputs = [str(tmp_path / "00000.tar"), str(tmp_path / "videos.jsonl")]
    clips = ["frames.clips.policy=head", "frames.clips.count=2"]
    with_vit = [*clips, "vit.encoder=clip_vision", "vit.path=tiny"]
    out, fresh = str(tmp_path / "store"), str(tmp_path / "fresh")
    first = encode(inputs, out, cluster, overrides=clips)
    assert first.samples_written == 6 and first.rejected == 1
    lines: list[str] = []
    assert encode(inputs, out, cluster, overrides=with_vit, log=lines.append).samples_written == 6
    assert any("adding vit_features to 4 sample(s) already in the store" in line for line in lines), lines  # the tar's
    assert any("adding vit_features to 2 sample(s) already in the store" in line for line in lines), lines  # the manifest's
    encode(inputs, fresh, cluster, overrides=with_vit)
    store, reference = featstore.open(out), featstore.open(fresh)
    assert sorted(store.sample_ids(with_fields=["vit_features"])) == sorted(reference.sample_ids()) == [
        "00000:v0=0", "00000:v0=10", "00000:v1=0", "00000:v1=10", "ramp=0", "ramp=10"]
    for sid in reference.sample_ids():
        assert store.read(sid, ["vit_features"])["vit_features"].tobytes() == reference.read(sid, ["vit_features"])["vit_features"].tobytes()
    assert encode(inputs, out, cluster, overrides=with_vit).tasks == 0


def test_an_id_in_two_parquet_files_is_one_sample_and_a_reject_naming_the_other(tmp_path, cluster):
    write_media_parquet(tmp_path / "a.parquet", [png(n) for n in range(3)], ["a0", "a1", "same id"], ids=["a0", "a1", "twice"])
    write_media_parquet(tmp_path / "b.parquet", [png(n) for n in range(10, 12)], ["same id, other file", "b1"], ids=["twice", "b1"])
    out = str(tmp_path / "store")
    both = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    # The two files' tasks run at once; the first input to have an id keeps it, whichever commits first.
    summary = encode(both, out, cluster)
    store = featstore.open(out)
    assert summary.samples_written == 4 and summary.rejected == 1 and sorted(store.sample_ids()) == ["a0", "a1", "b1", "twice"]
    assert by_id(store)["twice"]["source_uri"] == f"{tmp_path / 'a.parquet'}#2"
    (reject,) = store.rejects.to_pylist()
    assert reject["id"] == "twice" and reject["source"] == f"{tmp_path / 'b.parquet'}#0"
    assert f"an earlier input has it ({tmp_path / 'a.parquet'}#2)" in reject["reason"]
    assert encode(both, out, cluster).tasks == 0  # both done: a re-run reads neither again
    # A later file with an id an earlier run committed from another input: a reject naming it.
    write_media_parquet(tmp_path / "c.parquet", [png(20), png(21)], ["c0", "again"], ids=["c0", "a1"])
    summary = encode([str(tmp_path / "c.parquet")], out, cluster)
    store = featstore.open(out)
    assert summary.samples_written == 1 and summary.rejected == 1 and "c0" in store.sample_ids()
    reasons = {r["source"].rsplit("/", 1)[-1]: r["reason"] for r in store.rejects.to_pylist()}
    assert f"an earlier input has it ({tmp_path / 'a.parquet'}#1)" in reasons["c.parquet#1"]
    # The same file in another folder is the same input (moved, or named by another path): a resume.
    (tmp_path / "moved").mkdir()
    shutil.copy(tmp_path / "a.parquet", tmp_path / "moved" / "a.parquet")
    moved = encode([str(tmp_path / "moved" / "a.parquet")], out, cluster)
    assert moved.samples_written == 0 and moved.rejected == 0 and len(featstore.open(out).rejects) == 2


def test_a_tar_of_the_same_name_from_another_dataset_is_rejected_not_skipped(tmp_path, cluster):
    """Ids of tars are ``<stem>:<key>``: ``coyo/00000.tar`` after ``laion/00000.tar`` into one store
    repeats them. Members with other bytes are rejects naming the committed ones (not left out as
    if resumed); the same tar copied elsewhere is a resume."""
    for folder, offset in (("laion", 0), ("coyo", 500), ("copy", 0)):
        (tmp_path / folder).mkdir()
        with tarfile.open(tmp_path / folder / "00000.tar", "w") as archive:
            for n in range(3):
                add_member(archive, f"k{n}.png", png(offset + n))
                add_member(archive, f"k{n}.txt", f"{folder} {n}".encode())
    out = str(tmp_path / "store")
    assert encode([str(tmp_path / "laion" / "00000.tar")], out, cluster).samples_written == 3
    copied = encode([str(tmp_path / "copy" / "00000.tar")], out, cluster)
    assert copied.samples_written == 0 and copied.rejected == 0
    other = encode([str(tmp_path / "coyo" / "00000.tar")], out, cluster)
    store = featstore.open(out)
    assert other.samples_written == 0 and other.rejected == 3 and len(store) == 3
    reasons = {r["source"]: r["reason"] for r in store.rejects.to_pylist()}
    assert reasons[f"{tmp_path / 'coyo' / '00000.tar'}#k1.png"].startswith(
        f"duplicate id '00000:k1': an earlier input has it ({tmp_path / 'laion' / '00000.tar'}#k1.png)")


def test_a_manifest_row_and_a_tar_member_of_one_id_in_one_job_keep_the_row_and_reject_the_member(tmp_path, cluster):
    """Tar ids are known only on the worker; a row of the same job with a member's id is told to
    its task, so the member is a reject naming the row (it used to be dropped without a word)."""
    with tarfile.open(tmp_path / "00000.tar", "w") as archive:
        for n in range(2):
            add_member(archive, f"k{n}.png", png(n))
            add_member(archive, f"k{n}.txt", f"member {n}".encode())
    (tmp_path / "row.png").write_bytes(png(50))
    manifest = tmp_path / "rows.jsonl"
    manifest.write_text(json.dumps({"id": "00000:k1", "path": "row.png", "caption": "a row"}) + "\n")
    out = str(tmp_path / "store")
    summary = encode([str(manifest), str(tmp_path / "00000.tar")], out, cluster)
    store = featstore.open(out)
    assert sorted(store.sample_ids()) == ["00000:k0", "00000:k1"] and summary.rejected == 1
    assert by_id(store)["00000:k1"]["caption"] == "a row"
    (reject,) = store.rejects.to_pylist()
    assert reject["source"] == f"{tmp_path / '00000.tar'}#k1.png" and "an earlier input has it (row.png)" in reject["reason"], reject


def test_llava_json_for_a_vlm(tmp_path, cluster):
    path = write_llava(tmp_path, 4)
    records = json.loads(path.read_text())
    records.append({"id": "chat", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    records.append({"id": "gone", "image": "images/missing.png", "conversations": records[0]["conversations"]})
    path.write_text(json.dumps(records))
    out = str(tmp_path / "store")
    summary = encode([str(path)], out, cluster, preset="tiny-vlm")
    store = featstore.open(out)
    assert summary.samples_written == 5 and sorted(store.sample_ids()) == ["000000000", "000000001", "000000002", "000000003", "chat"]
    reasons = {r["id"]: r["reason"] for r in store.rejects.to_pylist()}
    assert list(reasons) == ["gone"] and reasons["gone"].startswith(f"missing file: no {tmp_path / 'images' / 'missing.png'} (")
    assert "data.media_root" in reasons["gone"]
    rows = by_id(store)
    assert rows["chat"]["modality"] == "text" and rows["000000001"]["source_path"] == "images/00000/000000001.png"
    assert rows["000000001"]["conversations_sha256"]


def test_llava_pretrain_as_it_ships_finds_its_images_folder(tmp_path, cluster):
    # blip_laion_cc_sbu_558k.json beside images/, rows naming "00000/000000000.png": no setting needed.
    path = write_llava(tmp_path, 3)
    records = [{**r, "image": r["image"].removeprefix("images/")} for r in json.loads(path.read_text())]
    records.append({**records[0], "id": "gone", "image": "00000/missing.png"})
    path.write_text(json.dumps(records))
    out = str(tmp_path / "store")
    summary = encode([str(path)], out, cluster, preset="tiny-vlm")
    store = featstore.open(out)
    assert summary.samples_written == 3 and sorted(store.sample_ids()) == ["000000000", "000000001", "000000002"]
    (reject,) = store.rejects.to_pylist()
    assert reject["id"] == "gone" and f"no {tmp_path / 'images' / '00000' / 'missing.png'}" in reject["reason"]


def _committed_shards(store: Path) -> int:
    index = store / "index"
    return len([p for p in index.iterdir() if p.suffix == ".parquet"]) if index.exists() else 0


def _killed_mid_way(cmd: list[str], out: Path, parts: int = 2) -> int:
    """Runs ``cmd`` (an encode into ``out``), kills its whole process group once ``parts`` shards
    are committed, and returns how many samples the store holds then."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 240
    while _committed_shards(out) < parts and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "the job finished before it could be killed; make it bigger"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    return len(featstore.open(str(out)))


def _rerun_completes(cmd: list[str], out: Path, partial: int, total: int) -> list[str]:
    """Runs ``cmd`` again to the end: only what the killed run had not committed is encoded, and
    the store verifies. Returns the store's ids."""
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    written = int(re.search(r"encoded (\d+) sample", rerun.stdout).group(1))
    assert written == total - partial, rerun.stdout  # committed parts are not encoded again
    assert f" {partial} already in the store" in rerun.stdout, rerun.stdout  # and counted as there
    assert subprocess.run([str(Path(sys.executable).parent / "mmcache"), "verify", str(out)], capture_output=True).returncode == 0
    return featstore.open(str(out)).index.column("id").to_pylist()


def test_killed_encode_of_tars_and_a_manifest_resumes_exactly_once(tmp_path):
    """Tars of images, a tar of videos cut into two clips each (``frames.clips``) and a JSONL
    manifest, on 2 worker processes: the command's whole process group (client, scheduler,
    workers) SIGKILLed after some parts committed, the re-run encodes only the rest, and every id
    (a clip's ``<id>=<frame>``) is there once; the re-run's end rewrites the small parts into one shard."""
    from mmcache.precompute.demo_data import make_dataset
    from tests.test_media import write_gray_ramp_video

    video = write_gray_ramp_video(tmp_path / "ramp.mp4", frames=30, fps=24)
    shards = tmp_path / "shards"
    shards.mkdir()
    for shard in range(2):
        write_tar(shards / f"{shard:05d}.tar", shard, 48)  # parts of 16: 3 shards per tar
    with tarfile.open(shards / "00002.tar", "w") as archive:
        for n in range(40):  # 16 videos per part: 3 parts
            add_member(archive, f"v{n:03d}.mp4", video)
            add_member(archive, f"v{n:03d}.txt", f"gray ramp {n}".encode())
    manifest = make_dataset(tmp_path / "rows", num_images=6, num_videos=0)
    rows = {f"media:image_{n:03d}.png" for n in range(6)}
    out = tmp_path / "store"
    # A tar's parts are shards of about run.shard_bytes: tiny's samples (~5 KB) would need a tar of
    # 50k of them to make two, so parts are capped at 16 samples here, to be killed between parts.
    cmd = [str(Path(sys.executable).parent / "mmcache"), "encode", "--config", "tiny", "--input", str(shards / "{00000..00002}.tar"),
           "--input", str(manifest), "--output", str(out), "--workers", "2", "--set", "frames.clips.policy=head",
           "--set", "frames.clips.count=2", "--set", "run.samples_per_task=16"]
    partial = _killed_mid_way(cmd, out)
    committed = featstore.open(str(out)).sample_ids()
    clips = Counter(i.split("=")[0] for i in committed if "=" in i)
    assert 0 < partial < 182 and set(clips.values()) <= {2}  # a video's clips commit together
    ids = _rerun_completes(cmd, out, partial, 182)
    images = {f"{shard:05d}:{shard:04d}{n:05d}" for shard in range(2) for n in range(48)}
    assert len(ids) == 182 and set(ids) == images | rows | {f"00002:v{n:03d}={frame}" for n in range(40) for frame in (0, 10)}
    store = featstore.open(str(out))
    assert {r["id"]: r["frame_indices"] for r in store.index.to_pylist()}["00002:v039=10"] == [10, 12, 14, 16, 18]
    assert len(store.shards) <= 2 and len(store.replaced) >= 9, (sorted(store.shards), len(store.replaced))


SHARED = Path(__file__).resolve().parents[2] / "shared"
TAEF2 = SHARED / "weights" / "taef2"


@pytest.mark.skipif(not (TAEF2 / "taef2_encoder.pth").exists(), reason="TAESD-F2 weights (../shared/weights/taef2) are absent")
def test_taef2_latent_of_a_tar_member_decodes_to_its_image(tmp_path, cluster):
    import numpy as np
    import torch
    from PIL import Image

    from mmcache.precompute.encoders.taef2 import load_taef2_decoder

    names = ["astronaut.png", "chelsea.png", "rocket.jpg"]
    with tarfile.open(tmp_path / "00000.tar", "w") as archive:
        for n, name in enumerate(names):
            add_member(archive, f"{n:09d}.{name.rsplit('.', 1)[1]}", (SHARED / "media" / "images" / name).read_bytes())
            add_member(archive, f"{n:09d}.txt", name.encode())
    out = str(tmp_path / "store")
    assert encode([str(tmp_path / "00000.tar")], out, cluster, preset="taef2", overrides=[f"vae.path={TAEF2}"]).samples_written == 3
    store = featstore.open(out)
    decoder = load_taef2_decoder(TAEF2)
    for row in store.index.to_pylist():
        with torch.no_grad():
            latent = torch.from_numpy(store.read(row["id"])["latent"].astype(np.float32))[:, 0][None]
            decoded = decoder(latent).clamp(0, 1)[0].permute(1, 2, 0).numpy()
        source = Image.open(SHARED / "media" / "images" / row["caption"]).convert("RGB")
        box = (row["crop_left"], row["crop_top"], row["crop_left"] + row["crop_width"], row["crop_top"] + row["crop_height"])
        reference = np.asarray(source.crop(box).resize((row["width"], row["height"]), Image.BICUBIC), dtype=np.float32) / 255
        psnr = 10 * np.log10(1.0 / float(np.mean((decoded - reference) ** 2)))
        assert psnr >= 27.0, (row["id"], psnr)


def test_small_tars_share_tasks_and_reruns_encode_nothing(tmp_path, cluster):
    """Eight small tars are read by one task per worker (``plan.group_units``), not one each: two
    shards, not eight small ones. Re-runs encode nothing, also after those shards were compacted
    into one and after the replaced objects were deleted (featstore.rewrite)."""
    from mmcache.featstore.rewrite import DataCompaction, compact_data, delete_replaced

    shards = tmp_path / "shards"
    shards.mkdir()
    good = [f"{s:05d}:{k}" for s in range(8) for k in write_tar(shards / f"{s:05d}.tar", s, 2)]
    out = str(tmp_path / "store")
    from mmcache.precompute.dry_run import dry_run

    planned = dry_run(load_config(EncodeConfig, "tiny", "encode", []), [str(shards / "*.tar")], out, workers=2)
    summary = encode([str(shards / "*.tar")], out, cluster)
    store = featstore.open(out)
    assert planned.tasks == summary.tasks == 2 and len(store.shards) == 2 and sorted(store.sample_ids()) == sorted(good), sorted(store.shards)
    assert encode([str(shards / "*.tar")], out, cluster).tasks == 0
    assert compact_data(store, DataCompaction(target_bytes=1 << 20)).written  # as `mmcache compact --target-bytes 1MiB`
    assert len(featstore.open(out).replaced) == 2
    again = encode([str(shards / "*.tar")], out, cluster)
    assert again.tasks == 0 and again.samples_written == 0
    assert len(delete_replaced(featstore.open(out).storage, grace_s=0)) == 2
    after_grace = encode([str(shards / "*.tar")], out, cluster)
    assert after_grace.tasks == 0 and after_grace.samples_written == 0
    ids = featstore.open(out).index.column("id").to_pylist()
    assert sorted(ids) == sorted(good)
    report = verify_store(featstore.open(out, strict=False))
    assert report.ok and not report.warnings, (report.problems, report.warnings)