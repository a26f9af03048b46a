"""``gputrain plan``: predicted memory and step time of each way to run a recipe, before the run (issue 30).

Work in progress: :mod:`gputrain.tools.plan.memory` predicts one step's tensor memory per device.
"""
