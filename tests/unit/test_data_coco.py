"""COCO instances: degenerate annotations counted exactly, targets validated, splits, generator."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils
from torchcodec.encoders import JpegEncoder

from gputrain.data.coco import COCODetection, detection_collate, split_coco
from gputrain.data.coco_sample import make_coco
from gputrain.data.images import DataError

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # pycocotools vs numpy 2

S = 16  # fixture images are S×S


def _rle(x1: int, y1: int, x2: int, y2: int) -> dict[str, Any]:
    m = np.zeros((S, S), np.uint8)
    m[y1:y2, x1:x2] = 1
    rle = mask_utils.encode(np.asfortranarray(m))
    return {"size": rle["size"], "counts": rle["counts"].decode()}


def _poly(x: float, y: float, w: float, h: float) -> list[list[float]]:
    return [[x, y, x + w, y, x + w, y + h, x, y + h]]


def _ann(ann_id: int, image_id: int, cat: int, bbox: list[float], seg: Any, crowd: int = 0) -> dict[str, Any]:
    return {
        "id": ann_id,
        "image_id": image_id,
        "category_id": cat,
        "bbox": bbox,
        "area": 1.0,
        "segmentation": seg,
        "iscrowd": crowd,
    }


def fixture_set(root: Path, extra: Sequence[dict[str, Any]] = ()) -> tuple[Path, Path]:
    """Six images with exactly known problems; returns (image_dir, json)."""
    images = {1: "a.jpg", 2: "b.jpg", 3: "c.jpg", 5: "d.jpg", 8: "e.jpg", 9: "f.jpg"}
    (root / "img").mkdir(parents=True, exist_ok=True)
    for name in images.values():
        JpegEncoder(torch.full((3, S, S), 90, dtype=torch.uint8)).to_file(root / "img" / name)
    anns = [
        _ann(10, 1, 7, [2, 2, 6, 6], _poly(2, 2, 6, 6)),  # fine
        _ann(11, 1, 3, [10, 10, 10, 4], _poly(10, 10, 10, 4)),  # runs off the right edge: clipped
        _ann(12, 1, 3, [0, 0, 4, 4], _rle(0, 0, 4, 4), crowd=1),  # crowd
        _ann(13, 1, 12, [1, 1, 5, 5], _rle(1, 1, 6, 6)),  # fine, RLE mask
        _ann(14, 1, 7, [3, 8, 4, 4], []),  # no segmentation: mask from box
        _ann(20, 2, 7, [4, 4, 0, 5], [[4, 4, 4, 9, 4, 9]]),  # zero width
        _ann(30, 3, 7, [1, 1, 3, 3], _rle(1, 1, 4, 4), crowd=1),  # crowd
        _ann(50, 5, 3, [20, 2, 5, 5], _poly(20, 2, 5, 5)),  # wholly outside: no area after clipping
        _ann(90, 9, 12, [-3, 4, 6, 6], _poly(-3, 4, 6, 6)),  # runs off the left edge: clipped
        _ann(91, 9, 3, [5, 5, -2, 3], _poly(5, 5, 1, 3)),  # negative width
        *extra,
    ]
    doc = {
        "images": [{"id": i, "file_name": n, "width": S, "height": S} for i, n in images.items()],
        "annotations": anns,
        "categories": [{"id": c, "name": f"c{c}"} for c in (12, 3, 7)],
    }
    (root / "instances.json").write_text(json.dumps(doc))
    return root / "img", root / "instances.json"


def test_every_drop_reason_counted_exactly(tmp_path: Path) -> None:
    image_dir, ann = fixture_set(tmp_path)
    train = COCODetection(image_dir, ann, train=True)
    assert train.drop_summary == {
        "clipped": 2,
        "zero_area": 3,
        "crowd": 2,
        "mask_from_box": 1,
        "no_valid_box_images": 4,
    }
    assert [image_id for image_id, _ in train.items] == [1, 9]
    val = COCODetection(image_dir, ann, train=False)
    assert len(val) == 6 and val.drop_summary["no_valid_box_images"] == 0  # evaluation keeps every image
    assert val.drop_summary["zero_area"] == 3 and val.drop_summary["crowd"] == 2
    _, empty = val[1]
    assert empty["boxes"].shape == (0, 4) and empty["masks"].shape == (0, S, S) and empty["image_id"] == 2


def test_targets_of_the_fixture(tmp_path: Path) -> None:
    train = COCODetection(*fixture_set(tmp_path))
    assert train.label_to_category == {1: 3, 2: 7, 3: 12} and train.class_names[0] == "background"
    image, target = train[0]
    assert image.shape == (3, S, S) and image.dtype == torch.float32 and 0 <= image.min() and image.max() <= 1
    assert target["image_id"] == 1
    assert target["boxes"].tolist() == [[2, 2, 8, 8], [10, 10, 16, 14], [1, 1, 6, 6], [3, 8, 7, 12]]
    assert target["labels"].tolist() == [2, 1, 3, 2] and target["labels"].dtype == torch.int64
    masks = target["masks"]
    assert masks.dtype == torch.uint8 and masks.shape == (4, S, S)
    assert masks[2].sum() == 25 and masks[2, 1:6, 1:6].all()  # the RLE, decoded by pycocotools
    assert (
        masks[3].sum() == 16 and masks[1].sum() == 6 * 4
    )  # box-filled mask; polygon clipped by the rasterizer
    assert target["iscrowd"].tolist() == [0, 0, 0, 0] and target["area"].dtype == torch.float32
    _, clipped = train[1]
    assert clipped["boxes"].tolist() == [[0, 4, 3, 10]]


def test_summary_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gputrain.data.coco"):
        ds = COCODetection(*fixture_set(tmp_path))
        for i in range(len(ds)):
            ds[i]
    records = [r for r in caplog.records if r.name == "gputrain.data.coco"]
    assert len(records) == 1 and "zero_area=3" in records[0].getMessage()


def test_unknown_category_names_annotation_file_and_id(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"annotation id 77 of image .*a\.jpg has category_id 99"):
        COCODetection(*fixture_set(tmp_path, [_ann(77, 1, 99, [1, 1, 2, 2], _poly(1, 1, 2, 2))]))


def test_degenerate_box_from_a_transform_never_reaches_the_model(tmp_path: Path) -> None:
    def squash(image: Any, target: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        target["boxes"] = target["boxes"] * torch.tensor([1.0, 1.0, 0.0, 1.0])  # x2 = 0 <= x1
        return image, target

    image_dir, ann = fixture_set(tmp_path)
    ds = COCODetection(image_dir, ann, transforms=squash)
    with pytest.raises(DataError, match=r"a\.jpg: annotation id 10 has box .*no area"):
        ds[0]


def test_image_size_mismatch_and_missing_image(tmp_path: Path) -> None:
    image_dir, ann = fixture_set(tmp_path)
    JpegEncoder(torch.zeros((3, S, S + 4), dtype=torch.uint8)).to_file(image_dir / "a.jpg")
    (image_dir / "f.jpg").unlink()
    ds = COCODetection(image_dir, ann)
    with pytest.raises(DataError, match=r"a\.jpg is 20x16 but .*16x16"):
        ds[0]
    with pytest.raises(DataError, match=r"f\.jpg"):
        ds[1]


def test_collate_keeps_lists(tmp_path: Path) -> None:
    ds = COCODetection(*fixture_set(tmp_path))
    images, targets = detection_collate([ds[0], ds[1]])
    assert isinstance(images, list) and len(images) == 2 and targets[1]["image_id"] == 9


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_coco(tmp_path_factory.mktemp("coco") / "set", num_images=10, size=64, seed=0)


def test_generated_set_has_every_kind_of_annotation(generated: Path) -> None:
    doc = json.loads((generated / "annotations" / "instances.json").read_text())
    anns = doc["annotations"]
    assert sorted(c["id"] for c in doc["categories"]) == [3, 7, 12]
    assert any(isinstance(a["segmentation"], list) for a in anns) and any(
        isinstance(a["segmentation"], dict) for a in anns
    )
    assert sum(a["iscrowd"] for a in anns) == 2
    assert any(a["bbox"][0] < 0 or a["bbox"][0] + a["bbox"][2] > 64 for a in anns)
    ds = COCODetection(generated / "images", generated / "annotations" / "instances.json")
    assert (
        ds.drop_summary["zero_area"] == 1
        and ds.drop_summary["crowd"] == 2
        and ds.drop_summary["clipped"] >= 1
    )
    assert ds.label_to_category == {1: 3, 2: 7, 3: 12}
    labels = set()
    for i in range(len(ds)):
        image, target = ds[i]
        assert image.shape == (3, 64, 64) and target["masks"].shape[1:] == (64, 64)
        assert torch.allclose(target["masks"].sum((1, 2)).float(), target["area"])  # masks match their areas
        labels |= set(target["labels"].tolist())
    assert labels == {1, 2, 3}


def test_split_coco_is_8_to_2_disjoint_and_deterministic(generated: Path, tmp_path: Path) -> None:
    src = generated / "annotations" / "instances.json"
    train_json, val_json = split_coco(src, 0.2, 0, tmp_path / "a")
    again = split_coco(src, val_fraction=0.2, seed=0, out_dir=tmp_path / "b")
    assert train_json.read_text() == again[0].read_text() and val_json.read_text() == again[1].read_text()
    train, val = json.loads(train_json.read_text()), json.loads(val_json.read_text())
    train_ids, val_ids = {im["id"] for im in train["images"]}, {im["id"] for im in val["images"]}
    assert len(train_ids) == 8 and len(val_ids) == 2 and not train_ids & val_ids
    assert train_ids | val_ids == {im["id"] for im in json.loads(src.read_text())["images"]}
    assert all(a["image_id"] in train_ids for a in train["annotations"])
    assert len(train["annotations"]) + len(val["annotations"]) == len(
        json.loads(src.read_text())["annotations"]
    )
    assert len(COCODetection(generated / "images", val_json, train=False)) == 2


def test_a_coco_task_built_without_a_run_folder_writes_nothing_where_it_runs(tmp_path, monkeypatch):
    """The Python API builds tasks before a Trainer picks a run folder: the split files go to a temporary folder."""
    from gputrain.config import load_config
    from gputrain.tasks import build_task

    root = make_coco(tmp_path / "coco", num_images=10, size=48)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    spec = build_task(load_config("coco-maskrcnn", [f"data.root={root}"]))
    assert list(work.iterdir()) == []
    assert len(spec.train_data) + len(spec.val_data) == 10 and len(spec.val_data) == 2
    split = Path(spec.task.val_annotations)
    assert split.is_file() and split.parent.name.startswith("gputrain-coco-splits-")
    ran = build_task(load_config("coco-maskrcnn", [f"data.root={root}", f"trainer.out={tmp_path / 'run'}"]))
    assert (tmp_path / "run" / "splits" / split.name).read_bytes() == split.read_bytes()  # the same split
    assert len(ran.val_data) == 2


def test_predict_maps_labels_to_the_categories_training_used_when_the_file_lists_them_out_of_id_order(tmp_path):
    """The fixture lists categories 12, 3, 7: training and ``gputrain predict`` both number them by increasing id."""
    from gputrain.config import load_config
    from gputrain.tasks.detection import for_prediction

    image_dir, ann = fixture_set(tmp_path)
    train = COCODetection(image_dir, ann, train=True)
    assert train.label_to_category == {1: 3, 2: 7, 3: 12}
    assert train.class_names == ["background", "c3", "c7", "c12"]
    task, _ = for_prediction(load_config("coco-maskrcnn", [f"data.root={tmp_path}"]), annotations=str(ann))
    assert task.label_to_category == {1: 3, 2: 7, 3: 12}
    assert task.class_names == ["background", "c3", "c7", "c12"]
    assert task.image_ids == {"a.jpg": 1, "b.jpg": 2, "c.jpg": 3, "d.jpg": 5, "e.jpg": 8, "f.jpg": 9}
