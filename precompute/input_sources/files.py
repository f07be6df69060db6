"""Today's two inputs as registry entries: a manifest (JSONL, CSV, or Parquet with a ``path``
column) and a folder of media with same-stem ``.txt`` captions. Both are read on the client by
``precompute.inputs`` (its rules: contained paths, regular files, sizes); a task reads each row's
file on its own."""

from __future__ import annotations

from mmcache.precompute.input_sources.base import InputSource, SourceOptions, SourceRead, register
from mmcache.precompute.inputs import read_inputs


def read_rows(url: str, options: SourceOptions) -> SourceRead:
    rows, rejects = read_inputs(url, storage_options=options.storage_options, allow_empty_caption=options.allow_empty_caption,
                                allow_outside_root=options.allow_outside_root, max_input_bytes=options.max_input_bytes,
                                allow_empty=options.allow_empty, allow_text_only=options.allow_text_only)
    return SourceRead(rows=rows, rejects=rejects)


MANIFEST = register(InputSource(name="manifest", suffixes=(".jsonl", ".ndjson", ".csv"), read=read_rows))
FOLDER = register(InputSource(name="folder", suffixes=("/",), read=read_rows))
