"""The drawing vocabulary of the sample scenes: palette, shapes, relations, backgrounds, and how to draw them.

Both scene generators draw with it: :mod:`diffusion.kit.sample` (the demo's default scenes) and
:mod:`diffusion.kit.scenes` (GenEval's six categories). It lives apart from both so neither has to import
the other for it; :mod:`diffusion.kit.sample` re-exports every name, where the rest of the project reads them.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40),
    "purple": (140, 60, 180), "orange": (245, 140, 30), "white": (245, 245, 245), "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle")
RELATIONS = {"above": (0, -1), "below": (0, 1), "to the left of": (-1, 0), "to the right of": (1, 0)}
BACKGROUNDS = {"gray": (128, 128, 128), "white": (235, 235, 235), "black": (25, 25, 25), "beige": (225, 210, 170)}


def with_article(word: str) -> str:
    """``word`` with "a" or "an" before it, as the captions write it ("an orange circle")."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    """One of :data:`SHAPES` centred at (``cx``, ``cy``) with half-size ``r``, filled flat."""
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.85), (cx - r, cy + r * 0.85)], fill=fill)


def canvas(rng: np.random.Generator, width: int, height: int) -> tuple[Image.Image, str]:
    """A background to draw on: one of :data:`BACKGROUNDS` with a soft gradient and noise, and its name."""
    bg_name = rng.choice(list(BACKGROUNDS))
    bg = np.array(BACKGROUNDS[bg_name], dtype=np.float32)
    # A soft gradient plus noise, so the background is not one flat value.
    ramp = np.linspace(-12, 12, width, dtype=np.float32)[None, :, None] * rng.uniform(-1, 1)
    noise = rng.normal(0, 4, size=(height, width, 1)).astype(np.float32)
    pixels = np.clip(bg + ramp + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(np.broadcast_to(pixels, (height, width, 3)).copy()), str(bg_name)
