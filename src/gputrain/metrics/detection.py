"""Exact distributed COCO evaluation: per-image results gathered to rank 0 and scored by pycocotools.

mAP is not a sum of per-image statistics (precision is ranked over the whole set), so the
detections themselves are gathered, not reduced. Results are keyed by image id: an image
seen twice (a padded sampler) is scored once, and ``images`` reports how many were scored.

``predictions.json`` holds one entry per detection with both ``bbox`` and (for segm)
``segmentation``, as detectron2 writes it. pycocotools' ``loadRes`` takes the area of an
entry from its box when a box is present, so to score ``segm`` the boxes are dropped first
(and to score ``bbox`` the masks); do the same when re-scoring the file by hand.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gputrain.dist import comm
from gputrain.metrics.base import Evaluator

if TYPE_CHECKING:
    from pycocotools.coco import COCO


IOU_TYPES = ("bbox", "segm")


def _pycocotools() -> tuple[Any, Any, Any]:
    try:
        from pycocotools import mask as mask_util
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("COCO evaluation needs pycocotools: pip install 'gputrain[coco]'") from e
    return COCO, COCOeval, mask_util


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[None]:
    """pycocotools prints progress on every call; keep it off the console unless asked."""
    if verbose:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def detections_to_coco(
    output: Mapping[str, torch.Tensor],
    image_id: int,
    label_to_category: Mapping[int, int] | None,
    with_masks: bool,
    mask_threshold: float = 0.5,
) -> list[dict[str, Any]]:
    """One image's torchvision detection output as COCO result entries.

    Boxes go from ``xyxy`` to ``xywh``; masks ``(N, 1, H, W)`` of probabilities are
    thresholded at ``mask_threshold`` and RLE-encoded (``counts`` decoded to str for JSON).
    """
    _, _, mask_util = _pycocotools()
    boxes = output["boxes"].detach().to("cpu", torch.float64)
    scores = output["scores"].detach().cpu().tolist()
    labels = output["labels"].detach().cpu().tolist()
    if len(labels) == 0:
        return []
    xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1).tolist()
    rles: list[dict[str, Any]] | None = None
    if with_masks:
        if "masks" not in output:
            raise KeyError(
                "CocoEvaluator(iou_types includes 'segm') got a detection output without 'masks'; "
                "pass iou_types=('bbox',) for a box-only model"
            )
        masks = (output["masks"].detach().cpu()[:, 0] > mask_threshold).numpy().astype(np.uint8)
        rles = mask_util.encode(np.asfortranarray(masks.transpose(1, 2, 0)))
        for rle in rles:
            rle["counts"] = rle["counts"].decode("utf-8")
    results = []
    for i, (box, score, label) in enumerate(zip(xywh, scores, labels, strict=True)):
        if label_to_category is None:
            category = int(label)
        elif int(label) in label_to_category:
            category = int(label_to_category[int(label)])
        else:
            raise KeyError(
                f"label {label} is not in label_to_category (keys {sorted(label_to_category)}); "
                "map every model label to a COCO category id"
            )
        entry: dict[str, Any] = {
            "image_id": image_id,
            "category_id": category,
            "bbox": box,
            "score": float(score),
        }
        if rles is not None:
            entry["segmentation"] = rles[i]
        results.append(entry)
    return results


def coco_stats(
    coco_gt: COCO,
    results: list[dict[str, Any]],
    iou_type: str,
    image_ids: Sequence[int],
    verbose: bool = False,
) -> list[float]:
    """pycocotools' 12 summary numbers for ``results`` on ``image_ids`` (0.0 each with no results).

    ``loadRes`` fails on an empty list, and no detection means no precision: mAP 0.
    """
    _, COCOeval, _ = _pycocotools()
    drop = "segmentation" if iou_type == "bbox" else "bbox"
    # Drop the other type's key (see the module docstring); deep copy, since loadRes edits entries.
    anns = [{k: copy.deepcopy(v) for k, v in r.items() if k != drop} for r in results]
    if not anns:
        return [0.0] * 12
    with _quiet(verbose):
        coco_dt = coco_gt.loadRes(anns)
        ev = COCOeval(coco_gt, coco_dt, iouType=iou_type)
        ev.params.imgIds = list(image_ids)  # score only what was evaluated, not the whole GT file
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return [float(s) for s in ev.stats]


class CocoEvaluator(Evaluator):
    """``bbox_mAP``, ``bbox_mAP50``, ``segm_mAP``, ``segm_mAP50`` and ``images`` via pycocotools.

    ``coco_gt`` is a ``pycocotools.coco.COCO`` or the path of a COCO annotation json (loaded
    lazily, on rank 0 only). ``label_to_category`` maps model labels to COCO category ids;
    None means the labels are the category ids.
    """

    def __init__(
        self,
        coco_gt: COCO | str | Path,
        iou_types: Sequence[str] = IOU_TYPES,
        label_to_category: Mapping[int, int] | None = None,
        *,
        verbose: bool = False,
    ) -> None:
        bad = [t for t in iou_types if t not in IOU_TYPES]
        if bad or not iou_types:
            raise ValueError(f"CocoEvaluator(iou_types={tuple(iou_types)}): choose from {IOU_TYPES}")
        if isinstance(coco_gt, (str, Path)) and not Path(coco_gt).is_file():
            raise FileNotFoundError(
                f"COCO ground truth {coco_gt} does not exist; pass the annotation json path"
            )
        self._coco_gt = coco_gt
        self.iou_types = tuple(iou_types)
        self.label_to_category = dict(label_to_category) if label_to_category is not None else None
        self.verbose = verbose
        self.results: dict[int, list[dict[str, Any]]] = {}
        """This rank's COCO results, by image id (images without detections map to [])."""

    @property
    def coco_gt(self) -> COCO:
        """The ground truth, loaded from its path on first use."""
        if not isinstance(self._coco_gt, (str, Path)):
            return self._coco_gt
        COCO, _, _ = _pycocotools()
        with _quiet(self.verbose):
            self._coco_gt = COCO(str(self._coco_gt))
        return self._coco_gt

    def update(self, outputs: Any, targets: Any, loss: torch.Tensor | None, batch_size: int) -> None:
        """Add a list of detection outputs and the matching targets (each with ``image_id``)."""
        if len(outputs) != len(targets):
            raise ValueError(f"{len(outputs)} detection outputs but {len(targets)} targets in the batch")
        for output, target in zip(outputs, targets, strict=True):
            if "image_id" not in target:
                raise KeyError("each target needs an 'image_id' (the COCO image id) for CocoEvaluator")
            image_id = int(target["image_id"])
            self.results[image_id] = detections_to_coco(
                output, image_id, self.label_to_category, with_masks="segm" in self.iou_types
            )

    def compute(self, device: torch.device, out_dir: Path | None = None) -> dict[str, float]:
        """Gather every rank's results to rank 0, score there, broadcast (collective)."""
        gathered = comm.gather_objects(self.results)
        metrics: dict[str, float] | None = None
        if gathered is not None:  # rank 0
            merged: dict[int, list[dict[str, Any]]] = {}
            for part in gathered:
                merged.update(part)
            image_ids = sorted(merged)
            # Sorted by image, each image's detections in model order: the same list whatever
            # the sharding, so pycocotools' stable sorts break score ties the same way.
            results = [r for i in image_ids for r in merged[i]]
            if out_dir is not None:
                Path(out_dir).mkdir(parents=True, exist_ok=True)
                (Path(out_dir) / "predictions.json").write_text(json.dumps(results))
            metrics = {"images": float(len(image_ids))}
            for iou_type in self.iou_types:
                stats = coco_stats(self.coco_gt, results, iou_type, image_ids, self.verbose)
                metrics[f"{iou_type}_mAP"], metrics[f"{iou_type}_mAP50"] = stats[0], stats[1]
        return comm.broadcast_object(metrics)
