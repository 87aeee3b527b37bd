"""DPG-Bench's prompts and image layout.

DPG-Bench (github.com/TencentQQGYLab/ELLA, ``dpg_bench/``) ships its 1,065 dense prompts as one text file
each, ``dpg_bench/prompts/ID.txt``, and its evaluator (``dist_eval.sh IMAGE_ROOT_PATH RESOLUTION``) reads
one PNG per prompt, ``IMAGE_ROOT_PATH/ID.png``: the prompt's images tiled two to a row, each
``RESOLUTION`` px, which it crops back in the order top left, top right, bottom left, bottom right
(``PIC_NUM`` of them, 4 by default) and asks a VQA model about. The folder must hold nothing else.
"""

from __future__ import annotations

import math
import os

from PIL import Image

from diffusion.errors import InputError

MAX_IMAGES = 4  # the evaluator's crops cover a 2x2 grid


def read_prompts(directory: str) -> list[tuple[str, str]]:
    """``(ID, prompt)`` for every ``ID.txt`` in ``directory`` (DPG-Bench's ``dpg_bench/prompts``), by name."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".txt"))
    if not names:
        raise InputError(f"{directory}: no ID.txt prompt files, as DPG-Bench's dpg_bench/prompts has")
    prompts = []
    for name in names:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                text = " ".join(f.read().split())
        except UnicodeDecodeError as e:
            raise InputError(f"{os.path.join(directory, name)}: not a text prompt (byte {e.start} is not UTF-8 "
                             f"text)") from None
        if not text:
            raise InputError(f"{os.path.join(directory, name)}: an empty prompt")
        prompts.append((name[:-len(".txt")], text))
    return prompts


def tile(images: list[Image.Image]) -> Image.Image:
    """Up to four equal-size images on one canvas, two to a row, in the evaluator's crop order."""
    if not 1 <= len(images) <= MAX_IMAGES:
        raise ValueError(f"DPG-Bench reads 1 to {MAX_IMAGES} images a prompt, not {len(images)}")
    width, height = images[0].size
    canvas = Image.new("RGB", (width * min(len(images), 2), height * math.ceil(len(images) / 2)), "white")
    for k, image in enumerate(images):
        canvas.paste(image.convert("RGB"), ((k % 2) * width, (k // 2) * height))
    return canvas


def write_layout(directory: str, images, ids: list[str], images_per_prompt: int) -> None:
    """Write ``images`` (``images_per_prompt`` per ID, in the IDs' order) as DPG-Bench's ``ID.png`` tiles."""
    os.makedirs(directory, exist_ok=True)
    for index, key in enumerate(ids):
        tile(list(images[index * images_per_prompt:(index + 1) * images_per_prompt])).save(
            os.path.join(directory, f"{key}.png"))
