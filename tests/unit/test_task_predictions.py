"""What each task makes of a model's output for ``gputrain predict`` and the run's pictures: labels at the image's
size, overlays in the classes' colours, captions. Known answers written by hand: a class ``k`` is painted in
``class_colour(k)`` (the sample-data generators' colours: class 0 (255, 0, 0), class 1 (0, 74, 255), class 2
(149, 255, 0)), blended half and half over a grey image of value 100."""

from __future__ import annotations

import torch

from gputrain.tasks.classification import ClassificationTask
from gputrain.tasks.detection import DetectionTask
from gputrain.tasks.segmentation import SegmentationTask

GREY = 100


def _pixels(picture: torch.Tensor) -> list[list[list[int]]]:
    """``(3, H, W)`` -> rows of ``[r, g, b]``."""
    return picture.permute(1, 2, 0).tolist()


def test_segmentation_labels_of_smaller_logits_are_resized_to_the_image_rows_and_columns_in_place():
    # Class 1 minus class 0 is +1 in the two left columns and -1 in the right one; bilinear resizing (half-pixel
    # centres) of the 2 x 3 logits to 4 x 6 gives +1, +1, +1, +0.5, -0.5, -1 across every row.
    logits = torch.zeros(2, 2, 3)
    logits[1] = torch.tensor([[1.0, 1.0, -1.0], [1.0, 1.0, -1.0]])
    labels = SegmentationTask(2).prediction(logits, (4, 6))
    assert labels.dtype == torch.uint8 and labels.tolist() == [[1, 1, 1, 1, 0, 0]] * 4
    same = torch.zeros(3, 2, 3)
    same[2, 0, 0] = same[1, 1, 2] = 1.0
    assert SegmentationTask(3).prediction({"out": same}, (2, 3)).tolist() == [[2, 0, 0], [0, 0, 1]]


def test_segmentation_overlay_paints_each_class_in_its_colour_and_leaves_other_values_clear():
    image = torch.full((3, 2, 3), GREY, dtype=torch.uint8)
    labels = torch.tensor([[0, 1, 2], [255, 3, 0]])  # 255 (ignored) and 3 (no such class of 3) stay as they were
    picture, caption = SegmentationTask(3).draw(image, labels)
    assert caption == "prediction"
    assert _pixels(picture) == [[[177, 50, 50], [50, 87, 177], [124, 177, 50]],
                                [[100, 100, 100], [100, 100, 100], [177, 50, 50]]]


def _detections(scores: list[float]) -> dict[str, torch.Tensor]:
    return {"boxes": torch.tensor([[2.0, 2.0, 12.0, 12.0], [25.0, 25.0, 35.0, 35.0]]), "labels": torch.tensor([1, 2]),
            "scores": torch.tensor(scores)}


def test_detections_scoring_at_least_one_half_are_drawn_in_their_class_colour():
    task = DetectionTask("instances.json", {1: 3, 2: 9}, class_names=["background", "cat", "dog"])
    image = torch.full((3, 40, 40), GREY, dtype=torch.uint8)
    picture, caption = task.draw(image, _detections([0.5, 0.49]), target={"labels": torch.tensor([1, 2])})
    assert caption == "1 found of 2"
    assert picture[:, 2, 7].tolist() == [255, 0, 0]  # label 1 is class 0 of the data: its box's top edge
    assert picture[:, 25, 30].tolist() == [GREY] * 3  # 0.49: not drawn
    picture, caption = task.draw(image, _detections([0.9, 0.5]))
    assert caption == "2 found"
    assert picture[:, 25, 30].tolist() == [0, 74, 255]  # label 2, class 1's colour


def test_detection_masks_are_blended_in_the_class_colour():
    task = DetectionTask("instances.json", {1: 3}, class_names=["background", "cat"])
    image = torch.full((3, 60, 60), GREY, dtype=torch.uint8)
    masks = torch.zeros(1, 1, 60, 60, dtype=torch.bool)
    masks[0, 0, 10:50, 10:50] = True
    output = {"boxes": torch.tensor([[8.0, 8.0, 52.0, 52.0]]), "labels": torch.tensor([1]),
              "scores": torch.tensor([0.8]), "masks": masks}
    picture, _ = task.draw(image, output)
    assert picture[:, 45, 45].tolist() == [169, 55, 55]  # 0.55 x 100 + 0.45 x (255, 0, 0), truncated
    assert picture[:, 56, 56].tolist() == [GREY] * 3


def test_classification_caption_names_the_top_class_its_probability_and_the_truth():
    task = ClassificationTask(3, class_names=["cat", "dog", "bird"])
    image = torch.full((3, 8, 8), GREY, dtype=torch.uint8)
    picture, caption = task.draw(image, {"labels": torch.tensor([1, 0, 2]), "scores": torch.tensor([0.75, 0.2, 0.05])},
                                 target=torch.tensor(2))
    assert caption == "dog 0.75 (true: bird)" and torch.equal(picture, image)
    prediction = task.prediction(torch.tensor([0.0, 2.0, 1.0]), (8, 8))  # logits -> the top 3 of 3 classes
    assert prediction["labels"].tolist() == [1, 2, 0]
    e = torch.tensor([1.0, 2.718281828459045, 7.38905609893065])  # exp(0), exp(1), exp(2)
    torch.testing.assert_close(prediction["scores"], torch.tensor([e[2], e[1], e[0]]) / e.sum())
