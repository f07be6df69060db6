"""Where tasks run and how a job survives what happens to them: the executors (``executors``,
``placement``, ``local_cluster``, ``devices``) and the faults around them: an in-process job's
crash journal (``crash_journal``), a job left without workers (``worker_watch``) and the nannies'
log (``nanny_log``). It runs ``worker/``'s code; ``worker/`` never imports it."""
