"""A tiny vision encoder worth aligning to (``model.repa``), fitted offline on the sample scenes.

A random encoder's features say nothing, so REPA's effect with one would mean nothing. The scene
generator knows what every pixel is, so the encoder is fitted with a dense supervised target: each 8×8
patch predicts the share of its pixels of each colour (the palette's and the backgrounds') and of each
shape (background, circle, square, triangle), and the class token the caption's spatial relation. Its
patch features then carry what a scene is made of and where: a stand-in for DINOv2 at this scale.

The fitted encoder ships in the package (``diffusion/kit/assets/tiny-repa-encoder``: a transformers
``ViTModel`` directory, config.json + model.safetensors + preprocessor_config.json, ≈0.4 MB), so a kit
needs no fitting: ``model.repa.encoder`` takes that directory (:data:`TINY_ENCODER_ASSET`).
``python -m diffusion.kit.encoder_fit --out DIR`` fits it again (about a CPU minute).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import time

import numpy as np
import torch
import torch.nn.functional as F

from diffusion.kit.sample import BACKGROUNDS, COLORS, RELATIONS, SHAPES

TINY_ENCODER_ASSET = pathlib.Path(__file__).resolve().parent / "assets" / "tiny-repa-encoder"
SIZE, PATCH = 64, 8  # the tiny kits' resolution; an 8×8 patch grid
TINY_VIT = dict(image_size=SIZE, patch_size=PATCH, num_channels=3, hidden_size=64, num_hidden_layers=3,
                num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
# colour classes: the palette and the backgrounds, white and black once
PALETTE = {**COLORS, **{k: v for k, v in BACKGROUNDS.items() if k not in COLORS}}
COLOR_NAMES = tuple(PALETTE)
RELATION_NAMES = ("none",) + tuple(RELATIONS)


def scenes(n: int, seed: int):
    """``n`` scenes at SIZE² (a square canvas, as the training crop) as (images (n,3,S,S) in [-1, 1],
    per-patch colour shares (n, P, colours), per-patch shape shares (n, P, 4), relation index (n,))."""
    from diffusion.kit.sample import render_scene
    rng = np.random.default_rng(seed)
    palette = np.array(list(PALETTE.values()), np.float32)
    images, colours, shapes, relations = [], [], [], []
    for _ in range(n):
        image, caption = render_scene(rng, SIZE, SIZE)
        pixels = np.asarray(image, np.float32)
        label = ((pixels[:, :, None, :] - palette) ** 2).sum(-1).argmin(-1)  # (S, S) colour class
        background = np.bincount(label.ravel(), minlength=len(PALETTE)).argmax()
        shape_of = {COLOR_NAMES.index(c): 1 + SHAPES.index(s)
                    for c, s in re.findall(r"(\w+) (circle|square|triangle)", caption) if c in PALETTE}
        shape = np.vectorize(lambda k: shape_of.get(int(k), 0) if k != background else 0)(label)
        colours.append(_shares(label, len(PALETTE)))
        shapes.append(_shares(shape, 1 + len(SHAPES)))
        relations.append(next((i for i, r in enumerate(RELATION_NAMES) if i and f" {r} " in caption), 0))
        images.append(pixels)
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2) / 127.5 - 1.0
    return x, torch.from_numpy(np.stack(colours)), torch.from_numpy(np.stack(shapes)), torch.tensor(relations)


def _shares(label: np.ndarray, classes: int) -> np.ndarray:
    """(P, classes): each patch's share of pixels per class, patches in row-major order."""
    grid = SIZE // PATCH
    onehot = np.eye(classes, dtype=np.float32)[label]  # (S, S, C)
    return onehot.reshape(grid, PATCH, grid, PATCH, classes).mean(axis=(1, 3)).reshape(grid * grid, classes)


def fit(steps: int = 500, batch_size: int = 32, train_images: int = 1536, seed: int = 0, lr: float = 2e-3) -> tuple:
    """The fitted ViTModel and a report (seconds, losses, held-out patch accuracy)."""
    from transformers import ViTConfig, ViTModel
    torch.manual_seed(seed)
    model = ViTModel(ViTConfig(**TINY_VIT), add_pooling_layer=False)
    width = TINY_VIT["hidden_size"]
    heads = torch.nn.ModuleDict({"colour": torch.nn.Linear(width, len(PALETTE)),
                                 "shape": torch.nn.Linear(width, 1 + len(SHAPES)),
                                 "relation": torch.nn.Linear(width, len(RELATION_NAMES))})
    x, colours, shapes, relations = scenes(train_images, seed)
    params = list(model.parameters()) + list(heads.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(seed)
    start, running = time.perf_counter(), None
    for _ in range(steps):
        idx = torch.randint(len(x), (batch_size,), generator=generator)
        loss = _loss(model, heads, x[idx], colours[idx], shapes[idx], relations[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
    seconds = time.perf_counter() - start
    model.eval().requires_grad_(False)
    hx, hc, hs, hr = scenes(256, seed + 1000)
    with torch.no_grad():
        states = model(pixel_values=hx).last_hidden_state
        patches = states[:, 1:]
        shape_acc = (heads["shape"](patches).argmax(-1) == hs.argmax(-1)).float().mean().item()
        colour_acc = (heads["colour"](patches).argmax(-1) == hc.argmax(-1)).float().mean().item()
        relation_acc = (heads["relation"](states[:, 0]).argmax(-1) == hr).float().mean().item()
    return model, {"seconds": round(seconds, 1), "steps": steps, "loss": round(running, 4), "seed": seed,
                   "held_out_patch_shape_accuracy": round(shape_acc, 3),
                   "held_out_patch_colour_accuracy": round(colour_acc, 3),
                   "held_out_relation_accuracy": round(relation_acc, 3)}


def _loss(model, heads, x, colours, shapes, relations) -> torch.Tensor:
    states = model(pixel_values=x).last_hidden_state
    patches = states[:, 1:]
    soft = lambda logits, target: -(target * F.log_softmax(logits, -1)).sum(-1).mean()  # noqa: E731
    return (soft(heads["colour"](patches), colours) + soft(heads["shape"](patches), shapes)
            + F.cross_entropy(heads["relation"](states[:, 0]), relations))


def save(model, report: dict, out) -> pathlib.Path:
    out = pathlib.Path(out)
    model.save_pretrained(out, safe_serialization=True)
    # what the encoder reads: images in [0, 1] normalised to [-1, 1] (its training input)
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "ViTImageProcessor", "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
         "size": {"height": SIZE, "width": SIZE}}, indent=2) + "\n")
    (out / "fit.json").write_text(json.dumps(report, indent=2) + "\n")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m diffusion.kit.encoder_fit", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(TINY_ENCODER_ASSET), help="directory to write (default: the asset)")
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, report = fit(steps=args.steps)
    print(json.dumps(report), flush=True)
    save(model, report, args.out)


if __name__ == "__main__":
    main()
