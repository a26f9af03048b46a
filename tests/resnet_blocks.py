"""The block names torchvision's ResNet splits into, in order: shared by the pipeline partitioning tests
(tests/unit/test_partition.py, tests/unit/test_pipeline_blocks.py)."""

from __future__ import annotations

RESNET_BLOCKS = [
    "conv1",
    "bn1",
    "relu",
    "maxpool",
    "layer1",
    "layer2",
    "layer3",
    "layer4",
    "avgpool",
    "flatten",
    "fc",
]
