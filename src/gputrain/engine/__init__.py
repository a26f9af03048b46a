"""The training engine: the Trainer, the epoch, evaluation, the run's state, and hooks that see a read-only view.

:mod:`~gputrain.engine.trainer` (join, build, loop), :mod:`~gputrain.engine.setup` (every ``auto`` resolved once,
then the built run), :mod:`~gputrain.engine.epoch` and :mod:`~gputrain.engine.evaluate` (the bodies),
:mod:`~gputrain.engine.hooks` (``Hook`` and ``RunContext``), :mod:`~gputrain.engine.callbacks` (the default hooks,
assembled by :mod:`~gputrain.engine.defaults`), :mod:`~gputrain.engine.record` (summary and cleanup).
Nothing is imported here: ``import gputrain.engine`` costs nothing.
"""
