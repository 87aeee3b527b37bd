"""A real-data bench set: scikit-learn's handwritten digits, as LAION-style parquet, and an independent judge.

The 1,797 8x8 grayscale digits (UCI's optical recognition set, which scikit-learn ships inside its
wheel) are images no one here drew. :func:`write_digits` writes them as the sample data's raw columns
(``key, caption, jpg, width, height, url``): upscaled to 64 px (bicubic), dark ink on white, captioned by
class ("a handwritten digit 3"), so ``convert/laion_to_mds.py`` converts them as it converts anything.
A fixed split holds one image in five out (``index % 5 == 0``).

:class:`DigitJudge` reads a generated image's class: a logistic regression on 8x8 area-averaged pixels,
fitted on the real training split only (never on generated images), after the same upscale and PNG round
trip the training data went through; :meth:`DigitJudge.real_accuracy` is its accuracy on the real
held-out split, the ceiling of what it can read.

    python -m diffusion.kit.digits --out out/bench-real/raw
"""

from __future__ import annotations

import argparse
import io
import json
import os

import numpy as np
from PIL import Image

from diffusion import cli, schema

SIZE = 64
HOLD_OUT_EVERY = 5  # index % 5 == 0 is the held-out split
PROMPT = "a handwritten digit {}"


def prompt(label: int) -> str:
    return PROMPT.format(int(label))


def load(split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """The digits of ``split`` ("train", "test" or "all"): (images (n, 8, 8) in 0..16, labels (n,))."""
    from sklearn.datasets import load_digits
    data = load_digits()
    index = np.arange(len(data.target))
    keep = {"train": index % HOLD_OUT_EVERY != 0, "test": index % HOLD_OUT_EVERY == 0, "all": index >= 0}[split]
    return data.images[keep], data.target[keep]


def to_image(digit: np.ndarray, size: int = SIZE) -> Image.Image:
    """An 8x8 digit (0..16 ink) as a ``size`` px RGB picture, dark ink on white."""
    gray = (255 - np.clip(digit, 0, 16) * (255 / 16)).astype(np.uint8)
    return Image.fromarray(gray).resize((size, size), Image.BICUBIC).convert("RGB")


def to_features(image: Image.Image) -> np.ndarray:
    """The judge's view of any picture: 8x8 area-averaged ink, 0..16, flattened."""
    gray = image.convert("L").resize((8, 8), Image.BOX)
    return (255 - np.asarray(gray, dtype=np.float64)).reshape(-1) * (16 / 255)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def write_digits(out, split: str = "train", rows_per_shard: int = 512) -> dict:
    """Write ``split`` as parquet shards under ``out`` (the sample data's raw columns); returns the manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    images, labels = load(split)
    arrow_schema = pa.schema([(schema.RAW_KEY, pa.string()), (schema.RAW_CAPTION, pa.string()),
                              (schema.RAW_IMAGE, pa.binary()), (schema.WIDTH, pa.int32()),
                              (schema.HEIGHT, pa.int32()), (schema.RAW_URL, pa.string())])
    shards = []
    for start in range(0, len(labels), rows_per_shard):
        part = range(start, min(start + rows_per_shard, len(labels)))
        rows = {schema.RAW_KEY: [f"digit-{split}-{i:05d}" for i in part],
                schema.RAW_CAPTION: [prompt(labels[i]) for i in part],
                schema.RAW_IMAGE: [_png(to_image(images[i])) for i in part],
                schema.WIDTH: [SIZE] * len(part), schema.HEIGHT: [SIZE] * len(part),
                schema.RAW_URL: [f"sklearn://load_digits/{split}/{i}" for i in part]}
        path = os.path.join(out, f"part-{len(shards):05d}.parquet")
        pq.write_table(pa.table(rows, schema=arrow_schema), path + ".tmp")
        os.replace(path + ".tmp", path)
        shards.append(os.path.basename(path))
    manifest = {"rows": int(len(labels)), "good": int(len(labels)), "split": split, "shards": shards,
                "classes": {str(k): int((labels == k).sum()) for k in range(10)},
                "source": "sklearn.datasets.load_digits (UCI optical recognition of handwritten digits)"}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


class DigitJudge:
    """A classifier fitted on the real training digits, as the training data shows them; it reads the
    class of any picture (:meth:`predict`) and of generated ones it has never seen."""

    def __init__(self, seed: int = 0):
        from sklearn.linear_model import LogisticRegression
        images, labels = load("train")
        features = np.stack([to_features(Image.open(io.BytesIO(_png(to_image(d))))) for d in images])
        self.model = LogisticRegression(max_iter=2000, C=0.5, random_state=seed).fit(features, labels)

    def predict(self, images) -> np.ndarray:
        return self.model.predict(np.stack([to_features(im) for im in images]))

    def accuracy(self, images, labels) -> float:
        return float((self.predict(images) == np.asarray(labels)).mean())

    def real_accuracy(self) -> float:
        """Accuracy on the real held-out digits (never seen in fitting)."""
        images, labels = load("test")
        return self.accuracy([to_image(d) for d in images], labels)


def label_of(caption: str) -> int | None:
    """The class a digit prompt names ("a handwritten digit 3" -> 3), None for other prompts."""
    head, _, tail = caption.strip().rpartition(" ")
    return int(tail) if head == PROMPT.format("").strip() and tail.isdigit() and len(tail) == 1 else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m diffusion.kit.digits", description=(
        "Write scikit-learn's handwritten digits as LAION-style parquet (64 px, captioned 'a handwritten digit "
        "N'), for convert/laion_to_mds.py: real images no one here drew."))
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--split", choices=("train", "test", "all"), default="train",
                        help="train: 4 in 5 images; test: the held-out fifth (index %% 5 == 0) (default: %(default)s)")
    args = parser.parse_args(argv)
    manifest = write_digits(args.out, args.split)
    print(f"wrote {manifest['rows']} digits ({args.split}) in {len(manifest['shards'])} shards to {args.out}")


if __name__ == "__main__":
    cli.run(main, "digits")
