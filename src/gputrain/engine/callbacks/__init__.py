"""The hooks every run gets (:func:`gputrain.engine.defaults.default_hooks`): checkpoints, logging, progress, pictures."""
