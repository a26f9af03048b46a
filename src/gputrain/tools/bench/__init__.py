"""``gputrain bench``: :mod:`~gputrain.tools.bench.scale` (device counts x batch sizes) and
:mod:`~gputrain.tools.bench.throughput` (real against synthetic data)."""
