"""``gputrain predict``: :mod:`~gputrain.tools.predict.command` checks and prepares (the launcher),
:mod:`~gputrain.tools.predict.run` predicts on each rank and writes the task's files on rank 0."""
