"""``gputrain data make coco``: a small learnable COCO instances set with every degenerate case the loader handles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchcodec.encoders import JpegEncoder

from gputrain.data import images as synth
from gputrain.data.coco import _pycocotools
from gputrain.data.images import PathLike

CATEGORY_IDS = (3, 7, 12, 18, 25, 33, 42, 52, 63, 75)  # deliberately not 1..K
_ANN_KEYS = ("id", "image_id", "category_id", "bbox", "area", "segmentation", "iscrowd")


def make_coco(
    out: PathLike, *, num_images: int = 32, size: int = 96, num_categories: int = 3, seed: int = 0
) -> Path:
    """Write ``out/images/*.jpg`` and ``out/annotations/instances.json``, a learnable COCO set; returns ``out``.

    Category ``i`` (id ``CATEGORY_IDS[i]``) is one polygon shape (``POLYGON_SHAPES[i]``) in one colour.
    Masks are polygons, every third one a compressed RLE; the last object of every fifth image is a
    crowd, the first of every fourth straddles the image border, and the first image has a zero-width box.
    """
    if not 1 <= num_categories <= len(CATEGORY_IDS) or size < 32:
        raise ValueError(f"need 1 <= num_categories <= {len(CATEGORY_IDS)} and size >= 32")
    _, mask_utils = _pycocotools()
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    images: list[dict[str, Any]] = []
    anns: list[dict[str, Any]] = []
    for i in range(num_images):
        image_id = 1000 + 7 * i  # non-contiguous ids, as real COCO has
        canvas = synth.noisy_background(rng, size, size)
        taken = np.zeros((size, size), bool)
        count = int(rng.integers(1, 4)) + (i % 5 == 4)
        for k in range(count):
            cat = int(rng.integers(0, num_categories))
            r = float(rng.uniform(0.12, 0.22) * size)
            for _ in range(20):  # rejection-sample a place that does not overlap earlier objects
                cx, cy = (float(v) for v in rng.uniform(r, size - r, size=2))
                if k == 0 and i % 4 == 1:
                    cx = -0.4 * r if rng.random() < 0.5 else size + 0.4 * r  # straddles the left/right edge
                poly = synth.polygon_points(cat, cx, cy, r)
                rle = mask_utils.merge(mask_utils.frPyObjects([poly], size, size))
                mask = mask_utils.decode(rle).astype(bool)
                if mask.any() and not (taken & mask).any():
                    break
            else:
                continue
            taken |= mask
            synth.paint(canvas, mask, synth.class_colour(cat), rng)
            crowd = int(i % 5 == 4 and k == count - 1)
            if crowd or len(anns) % 3 == 2:
                rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
                seg: Any = {"size": rle["size"], "counts": rle["counts"].decode("ascii")}
            else:
                seg = [poly]
            xs, ys = poly[0::2], poly[1::2]  # the unclipped extent: boxes may leave the image on purpose
            bbox = [min(xs), min(ys), round(max(xs) - min(xs), 2), round(max(ys) - min(ys), 2)]
            values = (len(anns) + 1, image_id, CATEGORY_IDS[cat], bbox, float(mask.sum()), seg, crowd)
            anns.append(dict(zip(_ANN_KEYS, values, strict=True)))
        if i == 0:  # a zero-width box, as annotation tools sometimes emit
            values = (len(anns) + 1, image_id, CATEGORY_IDS[0], [5, 5, 0, 10], 0.0, [[5, 5, 5, 15, 5, 15]], 0)
            anns.append(dict(zip(_ANN_KEYS, values, strict=True)))
        pixels = torch.from_numpy(canvas).permute(2, 0, 1).contiguous()
        JpegEncoder(pixels).to_file(out / "images" / f"{image_id:012d}.jpg", quality=95)
        images.append({"id": image_id, "file_name": f"{image_id:012d}.jpg", "width": size, "height": size})
    categories = [
        {"id": CATEGORY_IDS[c], "name": synth.POLYGON_SHAPES[c], "supercategory": "shape"}
        for c in range(num_categories)
    ]
    doc = {"info": {"description": "gputrain sample set"}, "images": images, "annotations": anns}
    (out / "annotations" / "instances.json").write_text(json.dumps({**doc, "categories": categories}))
    return out
