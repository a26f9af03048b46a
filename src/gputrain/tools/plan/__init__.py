"""``gputrain plan`` and ``--strategy auto``: predicted memory per device and step time of each way to run a recipe,
before the run (docs/plan.md). ``workload`` is the run's step, ``memory`` counts it on fake tensors, ``timing``
measures real steps, ``plans`` predicts and chooses, ``command`` prints."""
