"""What an encode job reads: manifests, folders, WebDataset tars, media Parquet files and LLaVA JSON
arrays, as input rows (``rows``) and units a worker reads once (``registry``), read safely
(``source_bytes``) and read again alone later (``located``).

Importing the package registers every built-in input source (each module registers itself with
``registry.register``), so a lookup in ``registry.SOURCES`` finds them whichever module is imported
first; they are plain Python (no torch, no dask)."""

from . import file_sources, llava, parquet_media, webdataset  # noqa: F401  (they register)
