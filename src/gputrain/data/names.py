"""Which file a training sample came from, for messages that name it (the replay of a non-finite step)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Subset

from gputrain.data.reader_clock import TimedReads
from gputrain.data.samplers import SeededSamples


def sample_file(dataset: Any, index: int) -> str:
    """The file of sample ``index`` of ``dataset``, through the wrappers gputrain and torch put around it; "" if the
    dataset does not say (tensors in memory, a dataset of the user's own without ``samples``)."""
    for _ in range(8):
        if isinstance(dataset, (SeededSamples, TimedReads)):
            dataset = dataset.dataset
        elif isinstance(dataset, Subset):
            index, dataset = int(dataset.indices[index]), dataset.dataset
        else:
            break
    # torchvision's folder datasets and ours list (path, ...) per sample; the COCO reader lists (image id, ...).
    samples = getattr(dataset, "samples", None)
    if isinstance(samples, (list, tuple)) and 0 <= index < len(samples):
        entry = samples[index]
        return str(entry[0] if isinstance(entry, (tuple, list)) else entry)
    items, coco = getattr(dataset, "items", None), getattr(dataset, "coco", None)
    if isinstance(items, list) and coco is not None and 0 <= index < len(items):
        return str(dataset.image_dir / coco.imgs[items[index][0]]["file_name"])
    return ""
