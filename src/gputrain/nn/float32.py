"""``trainer.fp32_modules``: run chosen modules outside autocast, in float32, under a 16-bit precision.

PyTorch's AMP advice for a region that overflows float16 (or loses too much in bfloat16) is to run it in float32:
autocast off, its floating inputs cast up. An entry names a module by its qualified name in the model
(``decoder.aspp``, ``layer4.2``), or every module of a type by its class name or the name of a class it derives
from (``LayerNorm``, ``_BatchNorm`` for every BatchNorm, SyncBatchNorm included). Under precision 32 nothing changes.

The module's class is swapped for a subclass whose ``forward`` does that around the original: names, parameters and
``state_dict`` keys stay the model's, so checkpoints load in either direction, and every strategy wraps it as it is.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn

_SUBCLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _up(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    if isinstance(value, (tuple, list)):
        return type(value)(_up(v) for v in value)
    return value


def _in_float32(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _SUBCLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
            with torch.autocast(device, enabled=False):
                return cls.forward(self, *_up(args), **{k: _up(v) for k, v in kwargs.items()})

        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                       "__qualname__": cls.__qualname__, "runs_in_float32": True})
    return _SUBCLASSES[cls]


def keep_float32(model: nn.Module, entries: list[str]) -> list[str]:
    """Swap the modules ``entries`` name (qualified names or class names) to run in float32; their qualified names.

    An entry that names nothing in ``model`` is one ``ValueError`` line with the closest names."""
    if not entries:
        return []
    named = dict(model.named_modules())
    chosen: list[str] = []
    for entry in entries:
        hits = [name for name, module in named.items()
                if name == entry or any(c.__name__ == entry for c in type(module).__mro__ if c is not nn.Module)]
        if not hits:
            types = sorted({c.__name__ for m in named.values() for c in type(m).__mro__[:1]})
            close = difflib.get_close_matches(entry, [n for n in named if n] + types, n=3, cutoff=0.6)
            hint = f"closest: {', '.join(close)}" if close else f"module types in it: {', '.join(types[:8])}"
            raise ValueError(f"trainer.fp32_modules: {entry!r} is no module of {type(model).__name__} (by qualified "
                             f"name or class); {hint}")
        chosen += [h for h in hits if h not in chosen]
    for name in chosen:
        module = named[name]
        if not getattr(type(module), "runs_in_float32", False):
            module.__class__ = _in_float32(type(module))
    return chosen
