"""The tiny-clip kit's score heads (``heads/{aesthetic,nsfw,watermark}.safetensors``), fitted offline so
every ``--embed`` path runs without the hub.

Each head is fitted to the sample data's own LAION-style metadata column on the tiny CLIP's normalised
image embeddings of its images (the 64 px centre crop): ``aesthetic`` -> ``aesthetic`` (in the LAION
aesthetic predictor's shape: Linear layers D-1024-128-64-16-1 without activations), ``nsfw`` ->
``punsafe`` (D-16-1, ReLU, sigmoid), ``watermark`` -> ``pwatermark`` (a linear probe, sigmoid).

What they mean: the sample generator draws those columns at random, independently of the picture
(:func:`diffusion.kit.sample.laion_metadata`), and the tiny CLIP is random too; so each head predicts
about its column's mean (aesthetic ~5, nsfw ~0.05, watermark ~0.2) with a little image-dependent
spread. They exercise the file format, the loading, the scores, ``--where`` on them and the
histograms. They say nothing about beauty, safety or watermarks.
"""

from __future__ import annotations

import io
import pathlib
import tempfile

import numpy as np

from diffusion.kit.build import HEAD_KINDS, HEADS_ASSET, HEADS_DIR, ensure_kit

FIT_ROWS = 128
_TARGETS = dict(zip(HEAD_KINDS, ("aesthetic", "punsafe", "pwatermark")))  # each head's sample-data column
_SHAPES = {"aesthetic": (1024, 128, 64, 16), "nsfw": (16,), "watermark": ()}


def _sample_embeddings(model_dir: pathlib.Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The tiny CLIP's image embeddings of the sample data's good rows, and their metadata columns."""
    import pyarrow.parquet as pq
    from PIL import Image
    from diffusion.convert.curate import ClipEmbedder
    from diffusion.kit.sample import write_sample_data
    crops, targets = [], {k: [] for k in _TARGETS.values()}
    with tempfile.TemporaryDirectory() as tmp:
        write_sample_data(tmp, n=FIT_ROWS, seed=1, rows_per_shard=FIT_ROWS)
        for path in sorted(pathlib.Path(tmp).glob("*.parquet")):
            table = pq.read_table(path, columns=["jpg", *targets])
            for row in table.to_pylist():
                try:
                    with Image.open(io.BytesIO(row["jpg"])) as im:
                        image = im.convert("RGB")
                except Exception:  # the sample's bad rows on purpose
                    continue
                w, h = image.size
                s = min(w, h)
                crop = image.crop(((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s)).resize((64, 64))
                crops.append(np.asarray(crop))
                for k in targets:
                    targets[k].append(float(row[k]))
    embeddings = ClipEmbedder(str(model_dir), device="cpu").images(crops)
    return embeddings, {k: np.asarray(v, np.float32) for k, v in targets.items()}


def fit_heads(model_dir) -> dict:
    """Fit and write the three heads into ``model_dir/heads/``; returns each one's fit (mean squared error)."""
    import torch
    from diffusion.convert.curate import HEAD_DEFAULTS, save_head
    model_dir = pathlib.Path(model_dir)
    x, targets = _sample_embeddings(model_dir)
    (model_dir / HEADS_DIR).mkdir(exist_ok=True)
    info = {}
    for kind, column in _TARGETS.items():
        torch.manual_seed(5)
        widths = (x.shape[1], *_SHAPES[kind], 1)
        layers = [torch.nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])]
        params = [p for layer in layers for p in layer.parameters()]
        sigmoid = HEAD_DEFAULTS[kind]["output"] == "sigmoid"
        relu = HEAD_DEFAULTS[kind]["activation"] == "relu"
        xs, ys = torch.as_tensor(x), torch.as_tensor(targets[column])
        with torch.no_grad():  # start at the column's mean: the last bias
            mean = ys.mean().clamp(1e-3, 1 - 1e-3) if sigmoid else ys.mean()
            layers[-1].bias.fill_(float(torch.logit(mean)) if sigmoid else float(mean))
        opt = torch.optim.Adam(params, lr=1e-3)
        for _ in range(300):
            h = xs
            for i, layer in enumerate(layers):
                h = layer(h)
                if relu and i < len(layers) - 1:
                    h = torch.relu(h)
            pred = torch.sigmoid(h[:, 0]) if sigmoid else h[:, 0]
            loss = torch.mean((pred - ys) ** 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
        save_head(str(model_dir / HEADS_DIR / f"{kind}.safetensors"), [(l.weight, l.bias) for l in layers], kind,
                  fitted_to=f"diffusion.kit.sample column {column} ({len(ys)} rows): random labels, see "
                            f"diffusion/kit/heads.py")
        info[kind] = {"column": column, "mse": round(float(loss), 5), "rows": len(ys)}
    return info


if __name__ == "__main__":  # refit the shipped heads: python -m diffusion.kit.heads
    import json
    import shutil
    with tempfile.TemporaryDirectory() as tmp:
        kit = ensure_kit("tiny-clip", pathlib.Path(tmp) / "clip", progress=False)
        info = fit_heads(kit)
        HEADS_ASSET.mkdir(parents=True, exist_ok=True)
        for kind in HEAD_KINDS:
            shutil.copyfile(kit / HEADS_DIR / f"{kind}.safetensors", HEADS_ASSET / f"{kind}.safetensors")
        (HEADS_ASSET / "fit.json").write_text(json.dumps(info, indent=1) + "\n")
        print(info)
