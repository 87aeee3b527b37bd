"""Prompt grids: images tiled with their prompts written under them, in a PNG that can be read back.

A grid carries its layout and prompts in a PNG text chunk, so :func:`read_grid` cuts a saved grid back
into images with their prompts: ``diffusion.generate`` and the image-logging callback write grids,
``diffusion.evaluate`` and the demo read them.
"""

from __future__ import annotations

import json
import math
import os

from PIL import Image, ImageDraw, ImageFont
from PIL.PngImagePlugin import PngInfo

GRID_KEY = "diffusion_grid"  # PNG text chunk holding the grid's layout and prompts


def make_grid(images, prompts, columns: int | None = None, *, min_tile: int = 128) -> Image.Image:
    """Tile ``images`` in ``columns`` columns with each one's prompt written under it.

    Small images are scaled up by a whole factor (nearest neighbour) to at least ``min_tile`` pixels
    wide so the labels stay readable; the layout is stored in ``grid.info`` for :func:`save_grid`.
    """
    images = list(images)
    prompts = list(prompts)
    if not images or len(images) != len(prompts):
        raise ValueError(f"make_grid needs one prompt per image, got {len(images)} images, {len(prompts)} prompts")
    tile_w, tile_h = images[0].size
    if any(im.size != (tile_w, tile_h) for im in images):
        raise ValueError("make_grid needs images of one size")
    columns = columns or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    scale = max(1, math.ceil(min_tile / tile_w))
    cell_w, cell_h = tile_w * scale, tile_h * scale
    font = _font(max(10, min(16, cell_w // 12)))
    labels = [_wrap(p, font, cell_w - 4) for p in prompts]
    line_h = font.getbbox("Ag")[3] + 2
    label_h = line_h * max(len(lines) for lines in labels) + 4
    grid = Image.new("RGB", (columns * cell_w, rows * (cell_h + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, lines) in enumerate(zip(images, labels)):
        x, y = (i % columns) * cell_w, (i // columns) * (cell_h + label_h)
        grid.paste(image.convert("RGB").resize((cell_w, cell_h), Image.NEAREST), (x, y))
        for j, line in enumerate(lines):
            draw.text((x + 2, y + cell_h + 2 + j * line_h), line, fill="black", font=font)
    grid.info[GRID_KEY] = json.dumps({"prompts": prompts, "columns": columns, "tile": [tile_w, tile_h],
                                      "scale": scale, "label_height": label_h})
    return grid


def save_grid(grid: Image.Image, path: str) -> str:
    """Write ``grid`` as PNG with its layout and prompts, so :func:`read_grid` can take it apart."""
    meta = PngInfo()
    if GRID_KEY in grid.info:
        meta.add_text(GRID_KEY, grid.info[GRID_KEY])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    grid.save(path, format="PNG", pnginfo=meta)
    return path


def is_grid(path: str) -> bool:
    with Image.open(path) as im:
        return GRID_KEY in getattr(im, "text", {})


def _layout(path: str, text: str, size: tuple[int, int]) -> dict:
    """A grid's layout (its PNG text chunk), checked: a layout it cannot be cut by is one
    :class:`~diffusion.errors.InputError` naming the file and the field."""
    from diffusion.errors import InputError

    def whole(value, least):
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    try:
        layout = json.loads(text)
    except ValueError:
        layout = None
    problem = None
    if not isinstance(layout, dict):
        problem = "its layout is not a JSON object"
    elif not isinstance(layout.get("prompts"), list) or not all(isinstance(p, str) for p in layout["prompts"]):
        problem = "no list of prompts"
    elif not whole(layout.get("columns"), 1):
        problem = f"columns {layout.get('columns')!r}, not a positive whole number"
    elif not (isinstance(layout.get("tile"), list) and len(layout["tile"]) == 2
              and all(whole(v, 1) for v in layout["tile"])):
        problem = f"tile {layout.get('tile')!r}, not [width, height] in pixels"
    elif not whole(layout.get("scale"), 1) or not whole(layout.get("label_height"), 0):
        problem = f"scale {layout.get('scale')!r} or label_height {layout.get('label_height')!r} not whole numbers"
    else:
        rows = math.ceil(len(layout["prompts"]) / layout["columns"])
        width = min(len(layout["prompts"]), layout["columns"]) * layout["tile"][0] * layout["scale"]
        height = rows * (layout["tile"][1] * layout["scale"] + layout["label_height"])
        if width > size[0] or height > size[1]:
            problem = f"its layout needs {width}x{height} px, the image is {size[0]}x{size[1]}"
    if problem:
        raise InputError(f"{path}: a prompt grid that cannot be cut into its images ({GRID_KEY}: {problem})")
    return layout


def read_grid(path: str) -> tuple[list[Image.Image], list[str]]:
    """The images (at their generated size) and prompts of a grid written by :func:`save_grid`."""
    with Image.open(path) as im:
        text = getattr(im, "text", {})
        if GRID_KEY not in text:
            raise ValueError(f"{path}: not a prompt grid written by diffusion.generate (no {GRID_KEY} metadata)")
        layout = _layout(path, text[GRID_KEY], im.size)
        grid = im.convert("RGB")
    (tile_w, tile_h), scale = layout["tile"], layout["scale"]
    cell_w, cell_h = tile_w * scale, tile_h * scale
    images = []
    for i in range(len(layout["prompts"])):
        x, y = (i % layout["columns"]) * cell_w, (i // layout["columns"]) * (cell_h + layout["label_height"])
        images.append(grid.crop((x, y, x + cell_w, y + cell_h)).resize((tile_w, tile_h), Image.NEAREST))
    return images, list(layout["prompts"])


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return ImageFont.load_default()


def _wrap(text: str, font, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if line and font.getlength(candidate) > width:
            lines.append(line)
            line = word
        else:
            line = candidate
    return lines + [line] if line else lines or [""]
