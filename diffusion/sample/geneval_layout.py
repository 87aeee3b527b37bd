"""GenEval's image folder layout, written and read.

GenEval's evaluator (github.com/djghosh13/geneval, ``evaluation/evaluate_images.py IMAGE_FOLDER``) reads
one folder per prompt, named by its index, holding that prompt's metadata line and its samples::

    IMAGE_FOLDER/00000/metadata.jsonl      the prompt's line of evaluation_metadata.jsonl
    IMAGE_FOLDER/00000/samples/0000.png    its images, 0000.png, 0001.png, ...

Prompts files of metadata lines (``.jsonl``: GenEval's ``evaluation_metadata.jsonl``, or
``python -m diffusion.kit.scenes`` output) are read by :func:`read_metadata`.
"""

from __future__ import annotations

import collections
import json
import os

from PIL import Image

from diffusion.errors import InputError

METADATA = "metadata.jsonl"
SAMPLES = "samples"


def _as_list(value) -> list:
    return value if isinstance(value, list) else [None]  # not a list: one bad requirement


def _requirement(req) -> bool:
    """Whether ``req`` is a requirement of GenEval's form: a class, a whole count, optional colour and position."""
    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    position = req.get("position") if isinstance(req, dict) else None
    return (isinstance(req, dict) and isinstance(req.get("class"), str) and whole(req.get("count"))
            and isinstance(req.get("color", ""), (str, type(None)))
            and (position is None or isinstance(position, list) and len(position) == 2
                 and isinstance(position[0], str) and whole(position[1])))


def read_metadata(path: str) -> list[dict]:
    """The metadata lines of a JSONL prompts file; each needs ``prompt`` (text) and ``tag``."""
    lines = []
    try:
        with open(path, encoding="utf-8") as f:
            texts = f.read().split("\n")  # as iterating the file splits (not at a U+2028 inside a string)
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not a JSONL text file (byte {e.start} is not UTF-8 text)") from None
    for number, text in enumerate(texts, start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(line, dict) or not isinstance(line.get("prompt"), str) or "tag" not in line:
            raise InputError(f"{path}:{number}: a metadata line needs \"prompt\" (text) and \"tag\", as "
                             f"GenEval's evaluation_metadata.jsonl has")
        for key in ("include", "exclude"):  # what the judge reads; a wrong form was its traceback after sampling
            if not all(_requirement(r) for r in _as_list(line.get(key, []))):
                raise InputError(f"{path}:{number}: \"{key}\" must be a list of {{\"class\": NAME, \"count\": N}} "
                                 f"(with \"color\", \"position\": [RELATION, INDEX] optional), as GenEval's has")
        lines.append(line)
    if not lines:
        raise InputError(f"{path}: no metadata lines")
    return lines


def write_layout(directory: str, images, lines: list[dict], images_per_prompt: int) -> None:
    """Write ``images`` (``images_per_prompt`` per line, in the lines' order) in GenEval's layout."""
    for index, line in enumerate(lines):
        folder = os.path.join(directory, f"{index:05d}")
        os.makedirs(os.path.join(folder, SAMPLES), exist_ok=True)
        with open(os.path.join(folder, METADATA), "w") as f:
            f.write(json.dumps(line) + "\n")
        for k in range(images_per_prompt):
            images[index * images_per_prompt + k].save(os.path.join(folder, SAMPLES, f"{k:04d}.png"))


def _prompt_folders(path: str) -> list[str]:
    return [os.path.join(path, n) for n in sorted(os.listdir(path))
            if n.isdigit() and os.path.isfile(os.path.join(path, n, METADATA))]


def is_layout(path: str) -> bool:
    """Whether directory ``path`` is a GenEval image folder (numbered folders with metadata.jsonl)."""
    return bool(_prompt_folders(path))


def iter_layout(path: str, skipped: collections.Counter):
    """Yield ``(image, metadata line)`` for every sample of a GenEval image folder."""
    for folder in _prompt_folders(path):
        with open(os.path.join(folder, METADATA)) as f:
            try:
                line = json.loads(f.readline())
            except json.JSONDecodeError as e:
                raise InputError(f"{os.path.join(folder, METADATA)}: not JSON ({e.msg})") from None
        samples = os.path.join(folder, SAMPLES)
        names = sorted(n for n in os.listdir(samples) if n.endswith(".png")) if os.path.isdir(samples) else []
        for name in names:
            try:
                with Image.open(os.path.join(samples, name)) as im:
                    image = im.convert("RGB")
            except (OSError, ValueError, Image.DecompressionBombError) as e:
                skipped[f"{os.path.join(samples, name)}: {type(e).__name__}"] += 1
                continue
            yield image, line
