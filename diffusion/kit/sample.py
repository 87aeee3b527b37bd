"""Procedural LAION-style sample data: the embedded default dataset for the demo and the tests.

``python -m diffusion.kit.sample --out DIR --n N --seed S`` writes parquet shards with the raw columns
of the data contract (``key, caption, jpg, width, height, url``) and LAION's per-row metadata
(``aesthetic, punsafe, pwatermark, similarity, LANGUAGE``, see :func:`laion_metadata`; what the
converter's ``--where`` filters on). Each good row is a drawn scene with a
compositional caption ("a red circle above a blue square"), a random size and aspect ratio, stored as
JPEG or PNG, sometimes grayscale, RGBA or CMYK. A small known set of rows is bad on purpose (truncated
bytes, not an image, empty caption, a 1x1 image); ``manifest.json`` says how many of each, so tests can
expect exact counts. A second caption column, ``recap``, stands in for a dense synthetic caption (what a
captioning model writes beside the alt-text: longer, and empty for about one row in ten, as when the
captioner skipped an image; ``manifest.json`` counts them), for ``--captions caption,recap``. The output
is a pure function of ``(n, seed)``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import os

import numpy as np
from PIL import Image, ImageDraw

from diffusion import schema
from diffusion import cli
# the drawing vocabulary, re-exported here where the rest of the project imports it
from diffusion.kit.shapes import BACKGROUNDS, COLORS, RELATIONS, SHAPES, canvas  # noqa: F401
from diffusion.kit.shapes import draw_shape as _draw_shape, with_article as _a

BAD_KINDS = ("truncated", "not_image", "empty_caption", "tiny")
BAD_FRACTION = 0.02  # of each kind, at least one each
MIN_SIDE, MAX_SIDE, MAX_ASPECT = 64, 1024, 2.5
RECAP = "recap"  # the second caption column
RECAP_EMPTY = 0.1  # share of rows whose recap is empty


def recap(caption: str, width: int, height: int, seed: int, index: int) -> str:
    """Row ``index``'s synthetic dense caption, from its own stream (the scenes are those drawn without
    it): the caption in a longer sentence with the picture's shape, or "" for about one row in ten."""
    rng = np.random.default_rng([seed, index, 2])
    if rng.random() < RECAP_EMPTY or not caption:
        return ""
    layout = "a square" if width == height else ("a wide" if width > height else "a tall")
    opening = ("The image shows", "This picture contains", "In this flat illustration there is")[int(rng.integers(3))]
    return f"{opening} {caption}, drawn with flat colours in {layout} {width} by {height} pixel frame."


def render_scene(rng: np.random.Generator, width: int, height: int) -> tuple[Image.Image, str]:
    """Draw one scene at ``width`` x ``height`` and return it (RGB) with its caption.

    Shapes stay inside the centre square, which is the crop training sees, so the caption holds for
    the crop too.
    """
    image, bg_name = canvas(rng, width, height)
    draw = ImageDraw.Draw(image)

    side = min(width, height)
    x0, y0 = (width - side) / 2, (height - side) / 2
    palette = [c for c in COLORS if c != bg_name]
    color1, shape1 = rng.choice(palette), rng.choice(SHAPES)
    if rng.random() < 0.5:  # one large shape near the centre
        r = side * rng.uniform(0.22, 0.34)
        cx = x0 + side / 2 + rng.uniform(-0.1, 0.1) * side
        cy = y0 + side / 2 + rng.uniform(-0.1, 0.1) * side
        _draw_shape(draw, shape1, cx, cy, r, COLORS[color1])
        caption = f"{_a(color1)} {shape1}"
        if rng.random() < 0.5:
            caption += f" on {_a(bg_name)} background"
    else:  # two shapes in a spatial relation
        color2 = rng.choice([c for c in palette if c != color1])
        shape2 = rng.choice(SHAPES)
        relation = rng.choice(list(RELATIONS))
        dx, dy = RELATIONS[relation]
        r = side * rng.uniform(0.14, 0.2)
        off = side * 0.25
        cx, cy = x0 + side / 2, y0 + side / 2
        _draw_shape(draw, shape1, cx + dx * off, cy + dy * off, r, COLORS[color1])
        _draw_shape(draw, shape2, cx - dx * off, cy - dy * off, r, COLORS[color2])
        caption = f"{_a(color1)} {shape1} {relation} {_a(color2)} {shape2}"
    return image, caption


def _random_size(rng: np.random.Generator) -> tuple[int, int]:
    while True:
        w, h = (int(v) for v in rng.integers(MIN_SIDE, MAX_SIDE + 1, size=2))
        if max(w, h) / min(w, h) <= MAX_ASPECT:
            return w, h


def _encode(rng: np.random.Generator, image: Image.Image) -> bytes:
    """Store the image the way web data comes: mostly JPEG, some PNG, a few odd modes."""
    buf = io.BytesIO()
    roll = rng.random()
    if roll < 0.05:
        image.convert("L").save(buf, "JPEG", quality=90)
    elif roll < 0.10:
        image.convert("CMYK").save(buf, "JPEG", quality=90)
    elif roll < 0.15:
        rgba = image.convert("RGBA")
        alpha = np.full((image.height, image.width), 255, np.uint8)
        alpha[: image.height // 8] = 0  # a transparent strip outside the centre square's shapes
        rgba.putalpha(Image.fromarray(alpha))
        rgba.save(buf, "PNG", compress_level=1)
    elif roll < 0.35:
        image.save(buf, "PNG", compress_level=1)  # zlib's fastest: the noisy scenes barely compress anyway
    else:
        image.save(buf, "JPEG", quality=int(rng.integers(75, 96)))
    return buf.getvalue()


def _bad_row(kind: str, rng: np.random.Generator) -> tuple[bytes, str, int, int]:
    if kind == "tiny":
        buf = io.BytesIO()
        Image.new("RGB", (1, 1), (200, 0, 0)).save(buf, "PNG")
        return buf.getvalue(), "a red dot", 1, 1
    if kind == "not_image":
        return b"<!doctype html><html><body>404 Not Found</body></html>", "a page, not a picture", 0, 0
    w, h = _random_size(rng)
    image, caption = render_scene(rng, w, h)
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    if kind == "truncated":
        return data[: len(data) // 2], caption, w, h
    return data, "", w, h  # empty_caption


METADATA = ("aesthetic", "punsafe", "pwatermark", "similarity", "LANGUAGE")
LANGUAGES = (("en", 0.85), ("de", 0.05), ("fr", 0.04), ("es", 0.03), ("nolang", 0.03))


def laion_metadata(seed: int, index: int) -> dict:
    """Row ``index``'s LAION-style metadata, drawn from its own stream (so the scenes are those drawn
    without it): ``aesthetic`` ~ N(5, 1) clipped to [1, 10] (LAION's aesthetic predictor), ``punsafe``
    ~ Beta(0.4, 8), mostly near 0 (NSFW probability), ``pwatermark`` ~ Beta(0.8, 3) (watermark
    probability), ``similarity`` ~ U(0.25, 0.4) (CLIP image-text cosine, above LAION's 0.28 cut mostly),
    ``LANGUAGE`` mostly ``en``."""
    rng = np.random.default_rng([seed, index, 1])
    languages, weights = zip(*LANGUAGES)
    return {"aesthetic": round(float(np.clip(rng.normal(5.0, 1.0), 1.0, 10.0)), 4),
            "punsafe": round(float(rng.beta(0.4, 8.0)), 5), "pwatermark": round(float(rng.beta(0.8, 3.0)), 5),
            "similarity": round(float(rng.uniform(0.25, 0.4)), 5),
            "LANGUAGE": str(rng.choice(languages, p=np.array(weights) / sum(weights)))}


def _bad_rows_plan(n: int, rng: np.random.Generator) -> dict[int, str]:
    per_kind = max(1, round(n * BAD_FRACTION))
    if n < per_kind * len(BAD_KINDS):
        return {}
    rows = rng.choice(n, size=per_kind * len(BAD_KINDS), replace=False)
    return {int(i): BAD_KINDS[j // per_kind] for j, i in enumerate(rows)}


def draw_row(rng: np.random.Generator, width: int, height: int, scenes: str = "default",
             hold_out: bool = False) -> tuple[Image.Image, str]:
    """One good row's scene: :func:`render_scene` (``scenes="default"``) or GenEval's six categories'
    forms (``"geneval"``, :mod:`diffusion.kit.scenes`); with ``hold_out`` no held-out colour-shape pair
    is drawn (a default scene naming one is drawn again from the same stream)."""
    if scenes == "geneval":
        from diffusion.kit import scenes as geneval
        return geneval.render_scene(rng, width, height, hold_out=hold_out)
    if scenes != "default":
        raise ValueError(f"unknown scenes {scenes!r}; choose default or geneval")
    image, caption = render_scene(rng, width, height)
    if hold_out:
        from diffusion.kit.scenes import caption_entries, held_out
        while any(held_out(inc.get("color", ""), inc["class"]) for line in caption_entries(caption)
                  for inc in line["include"] if "color" in inc):
            image, caption = render_scene(rng, width, height)
    return image, caption


def write_sample_data(out, n: int = 256, seed: int = 0, rows_per_shard: int = 128, scenes: str = "default",
                      hold_out: bool = False) -> dict:
    """Write ``n`` rows as parquet shards under ``out``; returns the manifest (also saved as JSON).

    ``scenes`` and ``hold_out`` go to :func:`draw_row`; at their defaults the data is what it always was.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    plan = _bad_rows_plan(n, rng)
    rows = {name: [] for name in (schema.RAW_KEY, schema.RAW_CAPTION, schema.RAW_IMAGE,
                                  schema.WIDTH, schema.HEIGHT, schema.RAW_URL, *METADATA, RECAP)}
    shards, all_recaps = [], []

    def flush():
        if not rows[schema.RAW_KEY]:
            return
        path = os.path.join(out, f"part-{len(shards):05d}.parquet")
        arrow_schema = pa.schema([(schema.RAW_KEY, pa.string()), (schema.RAW_CAPTION, pa.string()),
                                  (schema.RAW_IMAGE, pa.binary()), (schema.WIDTH, pa.int32()),
                                  (schema.HEIGHT, pa.int32()), (schema.RAW_URL, pa.string()),
                                  *((m, pa.float64()) for m in METADATA[:-1]), ("LANGUAGE", pa.string()),
                                  (RECAP, pa.string())])
        pq.write_table(pa.table(rows, schema=arrow_schema), path + ".tmp")
        os.replace(path + ".tmp", path)
        shards.append(os.path.basename(path))
        for column in rows.values():
            column.clear()

    for i in range(n):
        row_rng = np.random.default_rng([seed, i])  # each row depends on (seed, i) alone
        if i in plan:
            data, caption, w, h = _bad_row(plan[i], row_rng)
        else:
            w, h = _random_size(row_rng)
            image, caption = draw_row(row_rng, w, h, scenes, hold_out)
            data = _encode(row_rng, image)
        rows[schema.RAW_KEY].append(f"{i:09d}")
        rows[schema.RAW_CAPTION].append(caption)
        rows[schema.RAW_IMAGE].append(data)
        rows[schema.WIDTH].append(w)
        rows[schema.HEIGHT].append(h)
        rows[schema.RAW_URL].append(f"https://example.invalid/sample/{seed}/{i:09d}.jpg")
        for name, value in laion_metadata(seed, i).items():
            rows[name].append(value)
        rows[RECAP].append(recap(caption, w, h, seed, i))
        all_recaps.append(rows[RECAP][-1])
        if len(rows[schema.RAW_KEY]) == rows_per_shard:
            flush()
    flush()

    bad = {kind: sum(1 for k in plan.values() if k == kind) for kind in BAD_KINDS}
    empty_recaps = sum(1 for i, text in enumerate(all_recaps) if not text and i not in plan)
    manifest = {"rows": n, "good": n - len(plan), "bad": bad, "seed": seed, "shards": shards,
                "empty_recaps": empty_recaps,  # among the good rows
                **({"scenes": scenes} if scenes != "default" else {}), **({"hold_out": True} if hold_out else {}),
                "bad_keys": {f"{i:09d}": kind for i, kind in sorted(plan.items())}}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


DESCRIPTION = """Write procedural LAION-style sample data: parquet shards of drawn scenes and their captions.

Each good row is a scene of flat shapes with a compositional caption ("a red circle above a blue
square"), at a random size and aspect ratio, stored as JPEG or PNG, sometimes grayscale, RGBA or CMYK.
A few rows are bad on purpose (truncated bytes, not an image, empty caption, a 1x1 image).
Input: the row count and a seed; the output is a pure function of the two. Output: --out with
part-NNNNN.parquet shards (columns key, caption, jpg, width, height, url: what convert/laion_to_mds.py,
diffusion.online and diffusion.evaluate read; and LAION's metadata aesthetic, punsafe, pwatermark,
similarity, LANGUAGE, which the converter's --where filters on) and manifest.json (rows, good rows, bad rows by kind)."""
EXAMPLES = """examples:
  python -m diffusion.kit.sample --out out/demo/raw --n 1024 --seed 0
  python convert/laion_to_mds.py --input out/demo/raw --output out/demo/mds --model .cache/kit/tiny \\
      --resolutions 64                                               # then convert it"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m diffusion.kit.sample", description=DESCRIPTION,
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory: new, empty, or earlier sample data (its shards are rewritten)")
    parser.add_argument("--n", type=cli.positive_int, default=256, help="number of rows (default: %(default)s)")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0,
                        help="random seed of the scenes (default: %(default)s)")
    parser.add_argument("--rows-per-shard", type=cli.positive_int, default=128,
                        help="rows per parquet shard (default: %(default)s)")
    parser.add_argument("--scenes", choices=("default", "geneval"), default="default",
                        help="default: one shape, or two in a relation; geneval: also 'a red circle and a blue "
                             "square' and 'three green squares', GenEval's six categories (default: %(default)s)")
    parser.add_argument("--hold-out", action="store_true",
                        help="draw no held-out colour-shape pair (red square, green circle, blue triangle, yellow "
                             "square, purple circle, orange triangle, white square, black circle), so "
                             "`python -m diffusion.kit.scenes` prompts are combinations training never saw")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if os.path.exists(args.out):
        if not os.path.isdir(args.out):
            raise FileExistsError(errno.EEXIST, "--out is a file; give a directory", args.out)
        if os.listdir(args.out) and not os.path.exists(os.path.join(args.out, "manifest.json")):
            raise FileExistsError(errno.EEXIST, "--out holds files that are not sample data; give a new or "
                                                "empty directory", args.out)
    old_shards = []
    if os.path.exists(os.path.join(args.out, "manifest.json")):
        with open(os.path.join(args.out, "manifest.json")) as f:
            old_shards = json.load(f).get("shards", [])
    manifest = write_sample_data(args.out, args.n, args.seed, args.rows_per_shard, args.scenes, args.hold_out)
    for name in set(old_shards) - set(manifest["shards"]):  # earlier, larger sample data: drop its extra shards
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(args.out, os.path.basename(name)))
    print(f"wrote {manifest['rows']} rows ({manifest['good']} good, bad: {manifest['bad']}) "
          f"in {len(manifest['shards'])} shards to {args.out}")


if __name__ == "__main__":
    cli.run(main, "sample")
