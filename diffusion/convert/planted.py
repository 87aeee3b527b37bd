"""Planted duplicates: the sample data's images with transformed copies of some of them, to measure
``--dedupe near`` / ``semantic`` (recall per transform, false positives on the other scenes) and to test it.

:data:`TRANSFORMS` are the near-duplicates the issue names: re-encoded, resized, cropped a little,
mirrored, colour-jittered. :func:`planted_rows` returns the originals and the copies as raw rows with
the truth (which original each copy is of, by which transform); :func:`mismatch_captions` swaps some
rows' captions for other rows' (bench/bench_curation_training.py).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageEnhance, ImageOps


def _jpeg(image: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def reencode(image: Image.Image, rng) -> Image.Image:
    return Image.open(io.BytesIO(_jpeg(image, int(rng.integers(30, 60))))).convert("RGB")


def resize(image: Image.Image, rng) -> Image.Image:
    f = float(rng.uniform(0.5, 0.8))
    return image.resize((max(64, int(image.width * f)), max(64, int(image.height * f))), Image.BILINEAR)


def crop(image: Image.Image, rng) -> Image.Image:
    w, h = image.size
    dx, dy = int(w * rng.uniform(0.02, 0.05)), int(h * rng.uniform(0.02, 0.05))
    left, top = int(rng.integers(0, dx + 1)), int(rng.integers(0, dy + 1))
    return image.crop((left, top, w - (dx - left), h - (dy - top)))


def flip(image: Image.Image, rng) -> Image.Image:
    return ImageOps.mirror(image)


def jitter(image: Image.Image, rng) -> Image.Image:
    image = ImageEnhance.Brightness(image).enhance(float(rng.uniform(0.8, 1.2)))
    image = ImageEnhance.Contrast(image).enhance(float(rng.uniform(0.8, 1.2)))
    return ImageEnhance.Color(image).enhance(float(rng.uniform(0.7, 1.3)))


TRANSFORMS = {"reencode": reencode, "resize": resize, "crop": crop, "flip": flip, "jitter": jitter}


def planted_rows(rows: list[dict], copies_per_transform: int, seed: int = 0) -> tuple[list[dict], dict]:
    """(originals then copies as raw rows {key, caption, jpg, url}, truth {copy key: (original key,
    transform)}). ``rows``: decodable raw rows (key, caption, jpg); each transform copies
    ``copies_per_transform`` of them (different originals per transform where there are enough)."""
    rng = np.random.default_rng(seed)
    out = [{"key": r["key"], "caption": r["caption"], "jpg": r["jpg"], "url": f"https://example.com/{r['key']}.jpg"}
           for r in rows]
    truth = {}
    picks = rng.permutation(len(rows))
    k = 0
    for name, fn in TRANSFORMS.items():
        for _ in range(copies_per_transform):
            src = rows[int(picks[k % len(rows)])]
            k += 1
            with Image.open(io.BytesIO(src["jpg"])) as im:
                image = im.convert("RGB")
            key = f"{src['key']}~{name}"
            out.append({"key": key, "caption": src["caption"], "jpg": _jpeg(fn(image, rng), 90),
                        "url": f"https://example.com/{key}.jpg"})
            truth[key] = (src["key"], name)
    return out, truth


def mismatch_captions(rows: list[dict], share: float, seed: int = 0) -> set[str]:
    """Give a ``share`` of ``rows`` (replaced in the list) the caption of another row, one that differs
    from their own: alt-texts that do not describe their image, as a scrape has them. Returns their keys."""
    rng = np.random.default_rng(seed)
    captions = [r["caption"] for r in rows]
    mismatched = set()
    for i in rng.choice(len(rows), int(round(share * len(rows))), replace=False):
        others = [j for j in rng.permutation(len(rows))[:32] if captions[j] != captions[i]]
        if others:
            rows[i] = {**rows[i], "caption": captions[int(others[0])]}
            mismatched.add(rows[i]["key"])
    return mismatched


def measure(vectors: np.ndarray, keys: list[str], truth: dict, threshold: float) -> dict:
    """Recall per transform (a copy found: a duplicate of its original, either way round) and the false
    positive rate over the originals (one flagged as a duplicate of another scene), with the decision's
    own comparison (:func:`~diffusion.convert.neardup.duplicate_groups`; input order ranks)."""
    from diffusion.convert.neardup import duplicate_groups
    removed, partner = duplicate_groups(vectors, None, threshold)
    index = {k: i for i, k in enumerate(keys)}
    out = {}
    for name in TRANSFORMS:
        copies = [c for c, (_, t) in truth.items() if t == name]
        found = 0
        for c in copies:
            i, j = index[c], index[truth[c][0]]
            found += bool((removed[i] and _root(partner, removed, i) == _root(partner, removed, j))
                          or (removed[j] and _root(partner, removed, j) == _root(partner, removed, i)))
        out[name] = found / max(len(copies), 1)
    originals = [i for i, k in enumerate(keys) if k not in truth]
    planted = {truth[c][0] for c in truth}
    false = 0
    for i in originals:  # removed while not planted-related to the row it was matched with
        if removed[i]:
            other = keys[_root(partner, removed, i)]
            if truth.get(other, (None,))[0] != keys[i]:
                false += 1
    out["false_positive_rate"] = false / max(len(originals), 1)
    out["originals"], out["copies"], out["planted_originals"] = len(originals), len(truth), len(planted)
    return out


def _root(partner, removed, i):
    while removed[i]:
        i = partner[i]
    return i
