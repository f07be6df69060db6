"""What runs where the tasks run (a Dask worker, or a thread of the in-process executor): one task
into one shard (``tasks``), a task of tars or row groups (``unit_encode``), a row into encoder
input (``encoder_inputs``), the loaded encoders (``encoder_cache``, ``plugin``) and a commit that
overlaps the next task (``commit_ahead``)."""
