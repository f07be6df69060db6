"""Where tasks run and how a job survives what happens to them: the executors (``executors``,
``placement``, ``local_cluster``, ``devices``) and the fault handling around them: an in-process
job's crash journal, tasks whose worker died, a job left without workers, the nannies' log, and
daemon threads for inputs that hang (``crash_journal``, ``worker_deaths``, ``worker_watch``,
``nanny_log``, ``daemon_pool``)."""
