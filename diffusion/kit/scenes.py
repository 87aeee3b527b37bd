"""Compositional scenes in GenEval's six categories, and held-out prompt sets to test them.

GenEval (Ghosh et al. 2023) scores a text-to-image model per category: single object, two objects,
counting, colours, position and colour attribution. Each prompt comes with a metadata line saying what a
correct image holds (``tag``, ``prompt``, ``include``: ``[{"class", "count", "color"?, "position"?:
[relation, index of the include it is relative to]}]``, ``exclude``: ``[{"class", "count"}]``); here
the classes are the sample scenes' shapes and the colours their palette, so the same lines can be judged
programmatically (:mod:`diffusion.sample.judge`).

* :func:`held_out` is the fixed rule that sets colour-shape pairs aside: a third of the 24 pairs,
  every colour keeping two shapes and every shape five or six colours (none of the demo's prompts is
  held out). ``python -m diffusion.kit.sample --hold-out`` leaves them out of training data, and
  :func:`prompt_set` asks for them, so its prompts are combinations the model never saw.
* :func:`render_scene` draws the captions of all six categories (``--scenes geneval``): the default
  sample scenes' two forms plus "a red circle and a blue square" and "three green squares".
* :func:`draw_entry` draws an image that satisfies a metadata line (the judge's tests read them back).

``python -m diffusion.kit.scenes --out prompts.jsonl`` writes a held-out prompt set.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from PIL import Image, ImageDraw

from diffusion import cli
from diffusion.kit.shapes import BACKGROUNDS, COLORS, RELATIONS, SHAPES, canvas
from diffusion.kit.shapes import draw_shape as _draw_shape, with_article as _a

CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
NUMBERS = {2: "two", 3: "three", 4: "four"}
# Our captions' relation words -> GenEval's relation names (what metadata and the judge use).
RELATION_NAMES = {"above": "above", "below": "below", "to the left of": "left of", "to the right of": "right of"}
# Unit offsets (x right, y down) of each GenEval relation: the first object sits this way of the second.
OFFSETS = {RELATION_NAMES[k]: v for k, v in RELATIONS.items()}


def held_out(color: str, shape: str) -> bool:
    """Whether ``color``-``shape`` is a held-out pair: (colour's index + shape's index) mod 3 == 1, in
    the orders of :data:`COLORS` and :data:`SHAPES` (red square, green circle, blue triangle, ...)."""
    return (list(COLORS).index(color) + SHAPES.index(shape)) % 3 == 1


HELD_OUT = tuple((c, s) for c in COLORS for s in SHAPES if held_out(c, s))


def plural(shape: str) -> str:
    return shape + "s"


# ---- metadata lines (GenEval's format) ------------------------------------------------------------

def entry(tag: str, objects: list[tuple[str, str]], relation: str | None = None, count: int = 1,
          background: str | None = None) -> dict:
    """The metadata line of a prompt in category ``tag`` about ``objects`` (``(colour, shape)`` pairs).

    ``relation`` (GenEval's name, e.g. "left of") places the first object relative to the second;
    ``count`` is the counting category's number. Like GenEval, single-object, two-object, counting and
    position lines ask for the shapes only; colours and colour attribution also for their colours.
    """
    if tag not in CATEGORIES:
        raise ValueError(f"unknown category {tag!r}; choose from {', '.join(CATEGORIES)}")
    with_color = tag in ("colors", "color_attr")
    if tag == "counting":
        (color, shape), = objects
        prompt = f"{NUMBERS[count]} {color} {plural(shape)}"
        include = [{"class": shape, "count": count}]
        return {"tag": tag, "prompt": prompt, "include": include, "exclude": [{"class": shape, "count": count + 1}]}
    if tag in ("single_object", "colors"):
        (color, shape), = objects
        prompt = f"{_a(color)} {shape}" + (f" on {_a(background)} background" if background else "")
        include = [{"class": shape, "count": 1, **({"color": color} if with_color else {})}]
        return {"tag": tag, "prompt": prompt, "include": include}
    (c1, s1), (c2, s2) = objects
    if tag == "position":
        words = {v: k for k, v in RELATION_NAMES.items()}[relation]
        include = [{"class": s2, "count": 1}, {"class": s1, "count": 1, "position": [relation, 0]}]
        return {"tag": tag, "prompt": f"{_a(c1)} {s1} {words} {_a(c2)} {s2}", "include": include}
    include = [{"class": s, "count": 1, **({"color": c} if with_color else {})} for c, s in objects]
    return {"tag": tag, "prompt": f"{_a(c1)} {s1} and {_a(c2)} {s2}", "include": include}


def prompt_set(per_category: int = 16, seed: int = 0, held_out_only: bool = True) -> list[dict]:
    """Up to ``per_category`` distinct metadata lines per category, in :data:`CATEGORIES` order.

    With ``held_out_only`` every prompt names at least one held-out colour-shape pair (single object and
    colours: 8 pairs, each also on each background that is not its colour, so at most 32 prompts each).
    Two-object, colour-attribution and position prompts name two different shapes; the result is a pure
    function of the arguments.
    """
    rng = np.random.default_rng(seed)
    pairs = [(c, s) for c in COLORS for s in SHAPES]
    lines = []
    for tag in CATEGORIES:
        seen, tries = set(), 0
        while len(seen) < per_category and tries < 200 * per_category:
            tries += 1
            line = _random_entry(tag, rng, pairs)
            named = _objects(line)
            if (held_out_only and not any(held_out(c, s) for c, s in named)) or line["prompt"] in seen:
                continue
            seen.add(line["prompt"])
            lines.append(line)
    return lines


def _random_entry(tag: str, rng: np.random.Generator, pairs) -> dict:
    first = pairs[int(rng.integers(len(pairs)))]
    if tag in ("single_object", "colors"):
        backgrounds = [None] + [b for b in BACKGROUNDS if b != first[0]]
        return entry(tag, [first], background=backgrounds[int(rng.integers(len(backgrounds)))])
    if tag == "counting":
        return entry(tag, [first], count=int(rng.choice(list(NUMBERS))))
    others = [(c, s) for c, s in pairs if s != first[1] and c != first[0]]
    second = others[int(rng.integers(len(others)))]
    relation = str(rng.choice(list(OFFSETS))) if tag == "position" else None
    return entry(tag, [first, second], relation=relation)


def _objects(line: dict) -> list[tuple[str, str]]:
    """The (colour, shape) pairs a metadata line's prompt names, from the prompt's words."""
    words = line["prompt"].split()
    return [(w, _singular(words[i + 1])) for i, w in enumerate(words[:-1])
            if w in COLORS and _singular(words[i + 1]) in SHAPES]


def _singular(word: str) -> str:
    return word[:-1] if word.endswith("s") and word[:-1] in SHAPES else word


# ---- drawing -------------------------------------------------------------------------------------

def draw_entry(line: dict, rng: np.random.Generator, width: int = 64, height: int | None = None,
               background: str | None = None) -> Image.Image:
    """An image that satisfies ``line`` (a metadata line of :func:`entry`'s grammar), drawn as the sample
    scenes are: shapes inside the centre square, on one of the sample backgrounds that is none of the
    named colours (``background`` picks it)."""
    height = height or width
    named = _objects(line)
    colors = {c for c, _ in named}
    bg_rng = np.random.default_rng(rng.integers(2**32))
    while True:  # a background none of the shapes has as its colour
        image, bg_name = canvas(bg_rng, width, height)
        if (background or bg_name) == bg_name and bg_name not in colors:
            break
    _draw_objects(ImageDraw.Draw(image), line, named, rng, width, height)
    return image


def _draw_objects(draw, line: dict, named, rng: np.random.Generator, width: int, height: int) -> None:
    side = min(width, height)
    x0, y0 = (width - side) / 2, (height - side) / 2
    if line["tag"] == "counting":
        count = line["include"][0]["count"]
        (color, shape), = named
        r = side * rng.uniform(0.09, 0.12)
        cells = rng.choice(9, size=count, replace=False)  # a 3x3 grid of cells, one shape per cell
        for cell in cells:  # at least 5% of the side apart
            jx, jy = rng.uniform(-0.02, 0.02, size=2) * side
            cx, cy = x0 + side * (1 + 2 * (cell % 3)) / 6 + jx, y0 + side * (1 + 2 * (cell // 3)) / 6 + jy
            _draw_shape(draw, shape, cx, cy, r, COLORS[color])
    elif len(named) == 1:
        (color, shape), = named
        r = side * rng.uniform(0.22, 0.34)
        cx, cy = x0 + side / 2 + rng.uniform(-0.1, 0.1) * side, y0 + side / 2 + rng.uniform(-0.1, 0.1) * side
        _draw_shape(draw, shape, cx, cy, r, COLORS[color])
    else:
        relations = [inc["position"][0] for inc in line["include"] if "position" in inc]
        dx, dy = OFFSETS[relations[0] if relations else str(rng.choice(list(OFFSETS)))]
        r, off = side * rng.uniform(0.14, 0.2), side * 0.25
        cx, cy = x0 + side / 2, y0 + side / 2
        (c1, s1), (c2, s2) = named
        _draw_shape(draw, s1, cx + dx * off, cy + dy * off, r, COLORS[c1])
        _draw_shape(draw, s2, cx - dx * off, cy - dy * off, r, COLORS[c2])


def render_scene(rng: np.random.Generator, width: int, height: int, hold_out: bool = False) -> tuple[Image.Image, str]:
    """A training scene in any of the caption forms :func:`entry` writes (one object, sometimes on a
    named background; two in a relation; two joined by "and"; two to four of one kind), without
    held-out pairs if ``hold_out``. Returns the image and its caption."""
    pairs = [(c, s) for c in COLORS for s in SHAPES if not (hold_out and held_out(c, s))]
    line = _random_entry(("single_object", "position", "two_object", "counting")[int(rng.integers(4))], rng, pairs)
    return draw_entry(line, rng, width, height, background=_background(line["prompt"])), line["prompt"]


def _background(prompt: str) -> str | None:
    words = prompt.split()
    return words[-2] if len(words) > 2 and words[-1] == "background" and words[-2] in BACKGROUNDS else None


def caption_entries(caption: str) -> list[dict]:
    """The metadata lines a caption of this grammar is judged by, one per category it can be scored in:
    "a red circle" by single object and colours; "a red circle and a blue square" by two objects and
    colour attribution; a relation by position and, as it names two coloured shapes, by the same two
    (two shapes alike are told apart by colour: their position line names the colours, and they have no
    two-object line); "three red circles" by counting. ``[]`` for any other caption."""
    text = " ".join(caption.lower().strip().rstrip(".").split())
    named, words = _objects({"prompt": text}), text.split()
    counts = {v: k for k, v in NUMBERS.items()}
    if len(named) == 1 and words[0] in counts:
        lines = [entry("counting", named, count=counts[words[0]])]
    elif len(named) == 1:
        lines = [entry(t, named) for t in ("single_object", "colors")]
    elif len(named) == 2:
        alike = named[0][1] == named[1][1]
        lines = [entry(t, named) for t in (("color_attr",) if alike else ("two_object", "color_attr"))]
        relation = next((name for w, name in RELATION_NAMES.items() if f" {w} " in f" {text} "), None)
        if relation:
            line = entry("position", named, relation=relation)
            if alike:
                for inc, color in zip(line["include"], (named[1][0], named[0][0])):
                    inc["color"] = color
            lines.insert(0, line)
    else:
        return []
    for line in lines:
        line["prompt"] = text
    return lines


DESCRIPTION = """Write a held-out prompt set in GenEval's six categories for the sample scenes.

Every prompt names at least one colour-shape pair that `python -m diffusion.kit.sample --hold-out`
leaves out of training (red square, green circle, blue triangle, yellow square, purple circle, orange
triangle, white square, black circle). Output: JSON lines in GenEval's metadata format (tag, prompt,
include, exclude), which `python -m diffusion.evaluate --prompts-file FILE --judge` samples and judges."""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m diffusion.kit.scenes", description=DESCRIPTION)
    parser.add_argument("--out", required=True, metavar="JSONL", help="where the prompt set is written")
    parser.add_argument("--per-category", type=cli.positive_int, default=16,
                        help="prompts per category, at most (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt draw (default: %(default)s)")
    parser.add_argument("--all-pairs", action="store_true",
                        help="draw from every colour-shape pair, not only the held-out ones")
    args = parser.parse_args(argv)
    lines = prompt_set(args.per_category, args.seed, held_out_only=not args.all_pairs)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    counts = {t: sum(line["tag"] == t for line in lines) for t in CATEGORIES}
    print(f"wrote {len(lines)} prompts to {args.out}: " + ", ".join(f"{t} {n}" for t, n in counts.items()))


if __name__ == "__main__":
    cli.run(main, "scenes")
