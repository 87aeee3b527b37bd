"""A programmatic judge of the sample scenes in GenEval's six categories.

GenEval finds objects with a detector and names their colours with CLIP; our scenes are flat shapes on
known backgrounds, so the judge reads them back directly:

1. the centre square (where the sample scenes keep their shapes), at most :data:`WORK_SIDE` px, median
   filtered against noise and JPEG ringing;
2. the background is the colour of the border strip; each pixel goes to the nearest of the background
   and the palette colours (:data:`diffusion.kit.sample.COLORS`), a pixel far from all of them to none;
3. each colour's pixels, opened to drop thin edges, split into connected components; a component of at
   least :data:`MIN_AREA` of the square is an object;
4. an object's shape is read from how much of its bounding box it fills (square 1, circle π/4,
   triangle 1/2) and whether it narrows upward (the triangles point up); its colour is the palette colour
   nearest its median pixel, its place the centre of its box.

:func:`check` then applies a metadata line (GenEval's format, :mod:`diffusion.kit.scenes`) as GenEval's
evaluator does: every ``include`` needs ``count`` objects of its shape, and GenEval checks its most
confident detections of that shape (here the largest: a shape is read surely in proportion to its size),
so those ``count`` must be of its colour if it names one (a small red circle beside a larger blue one is
not "a red circle"); and,
with ``position``, each in that relation (box centres, offsets beyond a tenth of the two boxes' sizes)
to the objects of the include it names; an ``exclude`` fails at ``count`` or more objects of its shape.
One exception, for lines GenEval never writes: where a line names one shape twice ("a red circle and a
blue circle", :func:`diffusion.kit.scenes.caption_entries`), the largest of each colour are taken, since
the largest circle cannot be both (``alike_by_color``; False applies GenEval's rule to those too).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from PIL import Image

WORK_SIDE = 128  # larger centre squares are read at this size
BORDER = 0.03  # the border strip that gives the background colour, as a share of the side
MIN_AREA = 0.004  # an object covers at least this share of the centre square
FAR = 110.0  # a pixel farther than this (RGB distance) from every reference colour belongs to none
POSITION_THRESHOLD = 0.1  # GenEval's: offsets within this share of the boxes' sizes are no relation


@dataclasses.dataclass
class Found:
    """One object read from an image: its shape, colour, box centre and box size (as shares of the
    centre square's side), and area (share of the square)."""
    shape: str
    color: str
    x: float
    y: float
    width: float
    height: float
    area: float

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


def _palette() -> dict:
    from diffusion.kit.sample import COLORS
    return COLORS


def read_objects(image: Image.Image) -> list[Found]:
    """The objects of a scene, largest first."""
    from scipy import ndimage
    image = image.convert("RGB")
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    square = image.crop((left, top, left + side, top + side))
    if side > WORK_SIDE:
        square, side = square.resize((WORK_SIDE, WORK_SIDE), Image.BILINEAR), WORK_SIDE
    pixels = ndimage.median_filter(np.asarray(square, dtype=np.float32), size=(3, 3, 1))
    strip = max(1, int(round(side * BORDER)))
    border = np.concatenate([pixels[:strip].reshape(-1, 3), pixels[-strip:].reshape(-1, 3),
                             pixels[:, :strip].reshape(-1, 3), pixels[:, -strip:].reshape(-1, 3)])
    background = np.median(border, axis=0)
    colors = _palette()
    # A palette colour as close to the background as the background's own spread is not told apart from it.
    names = [n for n, v in colors.items() if np.linalg.norm(np.array(v) - background) > 40]
    centres = np.array([background] + [colors[n] for n in names], dtype=np.float32)
    distance = np.linalg.norm(pixels[:, :, None, :] - centres[None, None], axis=-1)
    label = distance.argmin(-1)
    label[distance.min(-1) > FAR] = 0
    structure = np.ones((3, 3), bool)
    found = []
    for index, name in enumerate(names, start=1):
        mask = ndimage.binary_opening(label == index, structure=structure) if side >= 32 else label == index
        components, count = ndimage.label(mask)
        for box_index, box in enumerate(ndimage.find_objects(components), start=1):
            part = components[box] == box_index
            area = int(part.sum())
            if area < MIN_AREA * side * side:
                continue
            shape = _shape(part)
            rgb = np.median(pixels[box][part], axis=0)
            color = min(colors, key=lambda n: np.linalg.norm(np.array(colors[n]) - rgb))
            ys, xs = box
            found.append(Found(shape, color, (xs.start + xs.stop) / 2 / side, (ys.start + ys.stop) / 2 / side,
                               (xs.stop - xs.start) / side, (ys.stop - ys.start) / side, area / side ** 2))
    return sorted(found, key=lambda f: -f.area)


def _shape(part: np.ndarray) -> str:
    """Square, circle or triangle, from the fill of the bounding box and the widths near top and bottom."""
    fill = part.mean()
    rows = part.sum(1)
    h = len(rows)
    top, bottom = rows[: max(1, h // 3)].mean(), rows[-max(1, h // 3):].mean()
    if fill < 0.64 or (fill < 0.8 and top < 0.6 * bottom):
        return "triangle"
    return "square" if fill > 0.88 else "circle"


def relations(a: Found, b: Found) -> set[str]:
    """Where ``a`` is relative to ``b`` (GenEval's rule): "left of", "right of", "above", "below"."""
    offset = np.array([a.x - b.x, a.y - b.y])
    size = np.array([a.width + b.width, a.height + b.height])
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * size, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    return {name for name, hit in (("left of", dx < -0.5), ("right of", dx > 0.5), ("above", dy < -0.5),
                                   ("below", dy > 0.5)) if hit}


def check(objects: list[Found], line: dict, alike_by_color: bool = True) -> tuple[bool, str]:
    """Whether ``objects`` (largest first) satisfy the metadata ``line``, and why not ("" when they do)."""
    reasons, groups = [], []
    named = [req["class"] for req in line.get("include", [])]
    for req in line.get("include", []):
        shape, count, color = req["class"], int(req["count"]), req.get("color")
        candidates = [o for o in objects if o.shape == shape]  # GenEval's: the most confident (largest) first
        if color and alike_by_color and named.count(shape) > 1:  # one shape named twice: told apart by colour
            candidates.sort(key=lambda o: o.color != color)
        chosen = candidates[:count]
        ok = len(chosen) >= count
        if not ok:
            reasons.append(f"expected {shape}>={count}, found {len(chosen)}")
        elif color and sum(o.color == color for o in chosen) < count:
            ok = False
            reasons.append(f"expected {color} {shape}>={count}, found " + ", ".join(o.color for o in chosen))
        if ok and "position" in req:
            relation, target = req["position"]
            anchors = groups[target] if target < len(groups) else None
            if anchors is None:
                ok = False
                reasons.append(f"no target for {shape} to be {relation}")
            else:
                for a in chosen:
                    for b in anchors:
                        seen = relations(a, b)
                        if relation not in seen:
                            ok = False
                            reasons.append(f"expected {shape} {relation} target, found {' and '.join(sorted(seen)) or 'none'}")
                            break
                    if not ok:
                        break
        groups.append(chosen if ok else None)
    for req in line.get("exclude", []):
        n = sum(o.shape == req["class"] for o in objects)
        if n >= int(req["count"]):
            reasons.append(f"expected {req['class']}<{req['count']}, found {n}")
    return not reasons, "; ".join(reasons)


def judge(image: Image.Image, line: dict) -> dict:
    """One image against one metadata line: ``{"tag", "prompt", "correct", "reason", "objects"}``."""
    objects = read_objects(image)
    correct, reason = check(objects, line)
    return {"tag": line["tag"], "prompt": line["prompt"], "correct": correct, "reason": reason,
            "objects": [o.as_dict() for o in objects]}


def summarize(results: list[dict]) -> dict:
    """Per-category accuracy (share of correct images), images per category, and GenEval's overall
    score: the mean of the categories' accuracies."""
    from diffusion.kit.scenes import CATEGORIES
    by_tag = {}
    for r in results:
        by_tag.setdefault(r["tag"], []).append(r["correct"])
    accuracy = {t: float(np.mean(by_tag[t])) for t in CATEGORIES if t in by_tag}
    return {"accuracy": accuracy, "images": {t: len(by_tag[t]) for t in accuracy},
            "overall": float(np.mean(list(accuracy.values()))) if accuracy else None}


def judge_many(pairs) -> tuple[list[dict], int]:
    """Judge ``(image, prompt or metadata line)`` pairs: a metadata line is applied as it is; a caption
    of the sample grammar by every category it can be scored in (:func:`diffusion.kit.scenes.caption_entries`).
    Returns one result per (image, line) and the number of images whose prompt the judge cannot read."""
    from diffusion.kit.scenes import caption_entries
    results, unjudged = [], 0
    for image, prompt in pairs:
        lines = [prompt] if isinstance(prompt, dict) else caption_entries(prompt or "")
        if not lines:
            unjudged += 1
            continue
        objects = read_objects(image)
        for line in lines:
            correct, reason = check(objects, line)
            results.append({"tag": line["tag"], "prompt": line["prompt"], "correct": correct, "reason": reason,
                            "objects": [o.as_dict() for o in objects]})
    return results, unjudged


def noise_floor(prompts, size: int = 64, images: int = 96, cells: int = 8, seed: int = 0) -> dict:
    """What an untrained model scores: the judge's per-category accuracy on ``images`` smooth colour-noise
    images (``cells`` x ``cells`` random colours, bilinear up to ``size`` px: blobs, as a barely trained
    model draws), the ``prompts`` in turn. Many blobs hold some shape of every kind, so a category near its
    floor says nothing about the model."""
    rng = np.random.default_rng(seed)
    pairs = [(Image.fromarray(rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8)).resize((size, size),
                                                                                              Image.BILINEAR),
              prompts[i % len(prompts)]) for i in range(images)]
    return summarize(judge_many(pairs)[0])["accuracy"]


def judge_pairs(pairs) -> tuple[dict, list[dict]]:
    """:func:`judge_many`, summarised (:func:`summarize`, with ``unjudged``), and the per-line results."""
    results, unjudged = judge_many(pairs)
    return {**summarize(results), "unjudged": unjudged}, results
