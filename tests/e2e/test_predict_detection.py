"""``gputrain predict`` of a detection model: the JSON takes the image ids of the annotation file, a new one for an
image it does not name once. That the JSON scores exactly as ``gputrain eval`` does (pycocotools mAP) is tested in
test_recipe_maskrcnn.py, on the checkpoint of the coco-maskrcnn run there rather than on a Mask R-CNN trained here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_detections_take_the_annotation_files_ids(tmp_path: Path) -> None:
    from torchcodec.encoders import JpegEncoder

    from gputrain.tasks.detection import DetectionTask
    from gputrain.tools.predict.run import list_inputs

    for name in ("img_3.jpg", "img_5.jpg", "new.jpg"):
        JpegEncoder(torch.full((3, 16, 16), 90, dtype=torch.uint8)).to_file(tmp_path / name)
    task = DetectionTask(tmp_path / "instances.json", {1: 7, 2: 9}, class_names=["background", "cat", "dog"],
                         image_ids={"images/img_3.jpg": 3, "img_5.jpg": 5})
    masks = torch.zeros(2, 1, 16, 16, dtype=torch.bool)
    masks[:, :, 2:8, 2:8] = True
    result = {"boxes": torch.tensor([[2.0, 2.0, 8.0, 8.0], [1.0, 1.0, 4.0, 5.0]]), "labels": torch.tensor([2, 1]),
              "scores": torch.tensor([0.9, 0.6]), "masks": masks}
    inputs = list_inputs([str(tmp_path / n) for n in ("new.jpg", "img_5.jpg", "img_3.jpg")])
    (tmp_path / "out").mkdir()
    task.write_predictions(inputs, [result, result, result], tmp_path / "out")
    entries = json.loads((tmp_path / "out/predictions.json").read_text())
    assert [e["image_id"] for e in entries] == [3, 3, 5, 5, 6, 6]  # sorted by id; new.jpg gets one past the file's
    assert [e["category_id"] for e in entries[:2]] == [9, 7]
    assert entries[0]["bbox"] == [2.0, 2.0, 6.0, 6.0] and entries[0]["segmentation"]["size"] == [16, 16]
    assert sorted(p.name for p in (tmp_path / "out/overlays").iterdir()) == ["img_3.jpg", "img_5.jpg", "new.jpg"]


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_an_image_whose_name_the_annotation_file_holds_twice_gets_a_new_id(tmp_path: Path) -> None:
    """Two images of the file share the name img.jpg (in two folders): which one was given is unknown, so it is
    numbered past the file's ids rather than scored against either's annotations."""
    from torchcodec.encoders import JpegEncoder

    from gputrain.tasks.detection import DetectionTask
    from gputrain.tools.predict.run import list_inputs

    for name in ("img.jpg", "only.jpg"):
        JpegEncoder(torch.full((3, 16, 16), 90, dtype=torch.uint8)).to_file(tmp_path / name)
    task = DetectionTask(tmp_path / "instances.json", {1: 7}, class_names=["background", "cat"],
                         image_ids={"train/img.jpg": 4, "val/img.jpg": 7, "val/only.jpg": 2})
    result = {"boxes": torch.tensor([[2.0, 2.0, 8.0, 8.0]]), "labels": torch.tensor([1]), "scores": torch.tensor([0.9])}
    (tmp_path / "out").mkdir()
    task.write_predictions(list_inputs([str(tmp_path / "img.jpg"), str(tmp_path / "only.jpg")]), [result, result],
                           tmp_path / "out")
    entries = json.loads((tmp_path / "out/predictions.json").read_text())
    assert [(e["image_id"], e["category_id"]) for e in entries] == [(2, 7), (8, 7)]
