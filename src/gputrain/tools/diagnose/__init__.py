"""``gputrain parity`` and ``gputrain doctor``: short runs on real ranks (:mod:`~gputrain.tools.diagnose.ranks`),
watched by probes (:mod:`~gputrain.tools.diagnose.probes`); parity compares modes with single, the doctor compares
ranks with each other. Importing this package imports no torch: the command line lists parity's modes from it."""

from gputrain.strategies import STRATEGIES

MODE_NAMES: tuple[str, ...] = ("single", "accumulation", *(name for name in STRATEGIES if name != "single"))
"""The modes of ``gputrain parity``, in the order it reports them: one per registered strategy, and gradient
accumulation in one process."""
