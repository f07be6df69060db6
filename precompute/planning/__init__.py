"""What an encode job will do, decided on the client before anything runs: the inputs' first pass
(``survey``), the plan and its tasks (``plan``), committed samples whose inputs changed
(``stale``) and the encoders' fields and estimated bytes (``feature_bytes``)."""
