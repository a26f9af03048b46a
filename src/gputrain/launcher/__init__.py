"""Starting ranks: what to launch (:mod:`~gputrain.launcher.spec`, asked of the strategy class), how
(:mod:`~gputrain.launcher.ranks`, :mod:`~gputrain.launcher.direct`) and the one failure report
(:mod:`~gputrain.launcher.failures`). :func:`gputrain.launch` and :func:`gputrain.launch_all` are here."""
