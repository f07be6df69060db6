"""What runs where the tasks run (a Dask worker, or a thread of the in-process executor): the typed
values a task is given (``specs``), one task into one shard (``tasks``), a task of tars or row
groups (``unit_encode``), a row into encoder input (``encoder_inputs``), the loaded encoders
(``encoder_cache``, ``plugin``), a commit that overlaps the next task (``commit_ahead``), threads
for inputs that may hang (``daemon_pool``) and tasks whose worker died (``deaths``)."""
