"""What an encode job writes to its store besides the tasks' shards: the output store opened,
created or checked (``store``), prompt embeddings (``prompts``), and the compaction after a job
(``compaction``)."""
