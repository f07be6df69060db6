"""The demo's generated dataset as WebDataset tars: every manifest sample in exactly one shard,
its media bytes and caption as the manifest has them, images and videos in each shard."""

from __future__ import annotations

import json
import tarfile

from mmcache.precompute.demo_data import make_dataset


def test_shards_hold_every_sample_once(tmp_path):
    manifest = make_dataset(tmp_path, num_images=5, num_videos=2, shards=2)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    seen: dict[str, bytes] = {}
    for shard in ("00000.tar", "00001.tar"):
        with tarfile.open(tmp_path / shard) as archive:
            members = {m.name: archive.extractfile(m).read() for m in archive.getmembers()}  # type: ignore[union-attr]
        assert {name.rsplit(".", 1)[1] for name in members} == {"png", "mp4", "txt"}
        assert not seen.keys() & members.keys()
        seen.update(members)
    assert len(seen) == 2 * len(rows)
    for row in rows:
        media = (tmp_path / row["path"])
        assert seen[media.name] == media.read_bytes() and seen[f"{media.stem}.txt"].decode() == row["caption"]
