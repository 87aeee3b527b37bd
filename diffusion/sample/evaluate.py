"""Score generated images: CLIP score against their prompts, FID against a reference set.

    python -m diffusion.evaluate --images grid.png [DIR ...] --reference DATA [...] --clip-model REF
    python -m diffusion.evaluate --checkpoint CKPT --prompts-file prompts.txt --reference DATA --clip-model REF

Inputs (``--images`` and ``--reference``) may be prompt grids written by ``diffusion.generate`` (their
prompts are stored in the PNG), images with an img2dataset-style sidecar caption (``0001.png`` +
``0001.txt``), raw-data files the converter reads (parquet with the contract's image column and, if it has
one, caption column: the sample data, download output; img2dataset webdataset tars), or directories of
any of these. With ``--checkpoint`` the images are generated first
(and kept with ``--save-images DIR``).

``--clip-model`` is a local directory or hub id that ``transformers.CLIPModel.from_pretrained`` loads
(``python -m diffusion.kit --preset tiny-clip --out DIR`` writes a tiny offline one). FID features
are that model's L2-normalised image embeddings by default ("FID_CLIP": Inception weights cannot be
downloaded everywhere, and CLIP features track human judgement at least as well); ``--fid-features
inception --inception-weights FILE`` uses torchvision's Inception-v3 pool features from a local
state dict instead. Neither number is comparable with published FIDs computed on other features.
With a reference set, CMMD (:mod:`diffusion.sample.cmmd`) is computed on the CLIP image embeddings too.

``--judge`` reads the sample scenes back (:mod:`diffusion.sample.judge`) and scores them in GenEval's six
categories; it needs no CLIP model. Prompts may be GenEval metadata lines (``--prompts-file X.jsonl``,
e.g. from ``python -m diffusion.kit.scenes``); ``--save-images`` then writes GenEval's folder layout
(``00000/metadata.jsonl``, ``00000/samples/0000.png``), which ``--images`` reads back and GenEval's own
evaluator reads. A directory of ``ID.txt`` prompts (DPG-Bench's ``dpg_bench/prompts``) as ``--prompts-file``
makes ``--save-images`` write DPG-Bench's layout (:mod:`diffusion.sample.dpg_layout`: ``ID.png``, the
prompt's images tiled 2x2). Every result records its protocol (sampler, steps, guidance, seed, image count,
size, each metric's feature model and the resizing in front of it). CLIP score is torchmetrics' ``CLIPScore``:
``max(mean(100 x cosine), 0)``.
"""

from __future__ import annotations

import argparse
import collections
import errno
import io
import json
import os
import sys

import numpy as np
import torch
from PIL import Image

from diffusion import schema
from diffusion.convert import readers
from diffusion.errors import InputError, ModelReferenceError, UserError
from diffusion import cli
from diffusion.sample import dpg_layout, geneval_layout, grid

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MIN_FID_IMAGES = 2  # a covariance needs two samples (a meaningful FID needs thousands)


# ---- inputs ---------------------------------------------------------------------------------------

def iter_images(paths, skipped: collections.Counter | None = None):
    """Yield ``(image, prompt or None)`` from grids, captioned image files, parquet shards or directories.

    Unreadable images are skipped and counted in ``skipped`` under ``"<source>: <reason>"``.
    """
    skipped = skipped if skipped is not None else collections.Counter()
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        path = os.fspath(path)
        if os.path.isdir(path) and geneval_layout.is_layout(path):
            yield from geneval_layout.iter_layout(path, skipped)
        elif os.path.isdir(path):
            children = [os.path.join(path, n) for n in sorted(os.listdir(path))
                        if n.lower().endswith(IMAGE_SUFFIXES + (".parquet", ".tar"))]
            yield from iter_images(children, skipped)
        elif path.endswith((".parquet", ".tar")):
            yield from _raw_images(path, skipped)
        elif os.path.isfile(path):
            yield from _file_images(path, skipped)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")


def _file_images(path: str, skipped: collections.Counter):
    try:
        if path.lower().endswith(".png") and grid.is_grid(path):
            yield from zip(*grid.read_grid(path))
            return
        with Image.open(path) as im:
            image = im.convert("RGB")
    except InputError as e:  # its message names the file and what is wrong with it
        skipped[str(e)] += 1
        return
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        skipped[f"{path}: {type(e).__name__}"] += 1
        return
    caption = os.path.splitext(path)[0] + ".txt"
    try:
        with open(caption, encoding="utf-8") as f:
            prompt = f.read().strip()
    except FileNotFoundError:
        prompt = None
    except (OSError, UnicodeDecodeError) as e:
        skipped[f"{caption}: unreadable caption ({type(e).__name__})"] += 1
        return
    yield image, prompt


def _raw_images(path: str, skipped: collections.Counter):
    """Images of a raw-data file (parquet with the contract's columns, or a webdataset tar), read by
    the converter's readers; a reference set for FID may have no captions."""
    for row in readers.iter_rows(path, readers.RawColumns(caption_required=False, column_flags=False)):
        try:
            with Image.open(io.BytesIO(row[schema.RAW_IMAGE])) as im:
                image = im.convert("RGB")
        except (OSError, ValueError, TypeError, Image.DecompressionBombError) as e:
            skipped[f"{path}: unreadable image ({type(e).__name__})"] += 1
            continue
        if min(image.size) < 8:
            skipped[f"{path}: image under 8 px"] += 1
            continue
        yield image, row[schema.RAW_CAPTION]


def _batches(pairs, size: int):
    batch = []
    for pair in pairs:
        batch.append(pair)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ---- feature models ---------------------------------------------------------------------------------

class ClipScorer:
    """A CLIP model: normalised image and text embeddings for CLIP score and FID_CLIP features."""

    def __init__(self, ref: str, device=None):
        from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel
        try:
            self.model = CLIPModel.from_pretrained(ref).eval().requires_grad_(False)
            self.tokenizer = AutoTokenizer.from_pretrained(ref)
        except OSError as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelReferenceError(f"--clip-model {ref}: cannot be loaded as a transformers CLIPModel ({reason}); "
                                      f"pass a local directory, e.g. one written by `python -m diffusion.kit "
                                      f"--preset tiny-clip`") from None
        size = self.model.config.vision_config.image_size
        try:
            self.processor = CLIPImageProcessor.from_pretrained(ref)
        except OSError:  # no preprocessor_config.json: CLIP's standard resize, crop and normalisation
            self.processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        self.max_length = self.model.config.text_config.max_position_embeddings

    @torch.no_grad()
    def image_features(self, images) -> np.ndarray:
        pixels = self.processor(images=list(images), return_tensors="pt")["pixel_values"].to(self.device)
        return _normalise(self.model.get_image_features(pixel_values=pixels))

    @torch.no_grad()
    def text_features(self, prompts) -> np.ndarray:
        tokens = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(self.device)
        return _normalise(self.model.get_text_features(input_ids=tokens["input_ids"],
                                                       attention_mask=tokens["attention_mask"]))


def _normalise(features: torch.Tensor) -> np.ndarray:
    features = getattr(features, "pooler_output", features)  # transformers 5 may return a model output
    return torch.nn.functional.normalize(features.float(), dim=-1).cpu().numpy().astype(np.float64)


class InceptionFeatures:
    """Inception-v3 2048-d pool features from a local torchvision state dict (no download here)."""

    # what is in front of the model, for the protocol
    resize = ("299x299 bilinear, the whole image squashed to the square (not cropped); ImageNet mean and std, "
              "then torchvision's transform_input")

    def __init__(self, weights: str, device=None):
        import torchvision
        if not weights or not os.path.exists(weights):
            raise FileNotFoundError(f"--fid-features inception needs local weights: {weights!r} not found "
                                    f"(torchvision's inception_v3 state dict, e.g. inception_v3_google-*.pth)")
        model = torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False,
                                                transform_input=True)
        model.load_state_dict(_inception_state(weights, model.state_dict()))
        model.fc = torch.nn.Identity()
        self.weights = weights
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.eval().requires_grad_(False).to(self.device)
        self.transform = torchvision.transforms.Compose([
            torchvision.transforms.Resize((299, 299), interpolation=torchvision.transforms.InterpolationMode.BILINEAR),
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])

    @torch.no_grad()
    def __call__(self, images) -> np.ndarray:
        batch = torch.stack([self.transform(im) for im in images]).to(self.device)
        return self.model(batch).double().cpu().numpy()


def _inception_state(path: str, expected: dict) -> dict:
    """The state dict in ``path``, checked against torchvision's Inception-v3 (``expected``): a file torch cannot
    read as one, or one of another layout, is refused in one line naming it."""
    wanted = "torchvision's inception_v3 state dict (1000 classes, with AuxLogits: inception_v3_google-*.pth)"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- a user's file: pickle's KeyError, EOFError, a zip's RuntimeError...
        raise InputError(f"--inception-weights {path}: not a torch state dict (torch.load: {type(e).__name__}); "
                         f"expected {wanted}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InputError(f"--inception-weights {path}: not a state dict of tensors; expected {wanted}")
    fc = state.get("fc.weight")
    if fc is not None and fc.shape[0] == 1008 and not any(k.startswith("AuxLogits.") for k in state):
        raise InputError(f"--inception-weights {path}: pytorch-fid's FID Inception layout (1008 classes, no "
                         f"AuxLogits), whose blocks pool otherwise than torchvision's, so its features would not be "
                         f"pytorch-fid's; expected {wanted}")
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        first = (f"{len(missing)} of its tensors missing, e.g. {missing[0]}" if missing else
                 f"{len(unexpected)} tensors it does not have, e.g. {unexpected[0]}" if unexpected else
                 f"{shapes[0]} is {tuple(state[shapes[0]].shape)}, not {tuple(expected[shapes[0]].shape)}")
        raise InputError(f"--inception-weights {path}: not torchvision's Inception-v3 ({first}); expected {wanted}")
    return state


def feature_models(clip_model: str | None, fid_features: str = "clip", inception_weights: str | None = None,
                   device=None) -> tuple:
    """``(CLIP scorer, Inception features)``, loaded (both None without ``clip_model``; Inception None where FID
    compares CLIP's features): a model that cannot be loaded is refused here in one line, so that
    ``diffusion.evaluate --checkpoint`` refuses it before generating."""
    if fid_features not in ("clip", "inception"):
        raise ValueError(f"unknown FID features {fid_features!r}; choose clip or inception")
    if not clip_model:
        return None, None
    scorer = ClipScorer(clip_model, device=device)
    return scorer, InceptionFeatures(inception_weights, device=device) if fid_features == "inception" else None


def reference_features(reference, scorer: ClipScorer, inception=None, batch_size: int = 32) -> tuple:
    """``(CLIP features, FID features, skipped)`` of the reference set (paths, or ``(image, caption)`` pairs); a set
    without one readable image is refused in one line."""
    skipped = collections.Counter()
    pairs = iter_images(reference, skipped) if _is_paths(reference) else iter(reference)
    clip_feats, fid_feats = [], []
    for batch in _batches(pairs, batch_size):
        batch_images = [im for im, _ in batch]
        clip_feats.append(scorer.image_features(batch_images))
        fid_feats.append(clip_feats[-1] if inception is None else inception(batch_images))
    if not fid_feats:
        raise InputError(f"no readable reference images in {reference!r}" + _first_reason(skipped))
    return np.concatenate(clip_feats), np.concatenate(fid_feats), skipped


# ---- metrics ------------------------------------------------------------------------------------------

def frechet_distance(features_a: np.ndarray, features_b: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets (rows are samples).

    ``|mu_a - mu_b|² + Tr(A) + Tr(B) - 2 Tr((A B)^½)``. The last trace equals the nuclear norm of
    ``A^½ B^½``, or, with fewer samples than dimensions, of the centred data product ``X_a X_bᵀ`` scaled:
    exact either way, real by construction, and far faster than ``scipy.linalg.sqrtm`` at 2048-d.
    """
    from scipy import linalg
    for name, f in (("first", features_a), ("second", features_b)):
        if len(f) < MIN_FID_IMAGES:
            raise ValueError(f"FID needs at least {MIN_FID_IMAGES} images per set; the {name} set has {len(f)}")
    xa = features_a - features_a.mean(0)
    xb = features_b - features_b.mean(0)
    (na, dim), nb = xa.shape, len(xb)
    cov_a, cov_b = xa.T @ xa / (na - 1), xb.T @ xb / (nb - 1)
    if min(na, nb) < dim:
        trace_sqrt = linalg.svdvals(xa @ xb.T).sum() / np.sqrt((na - 1) * (nb - 1))
    else:
        trace_sqrt = linalg.svdvals(_psd_sqrt(cov_a) @ _psd_sqrt(cov_b)).sum()
    diff = features_a.mean(0) - features_b.mean(0)
    return float(max(0.0, diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2 * trace_sqrt))


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh(matrix)
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def clip_metrics(image_features: np.ndarray, prompts: list[str], scorer: ClipScorer) -> dict:
    """CLIP score of each image against its prompt, a mismatched-prompt baseline, and retrieval accuracy.

    ``clip_score`` is :data:`CLIP_SCORE_PROTOCOL`; ``clip_score_mismatched`` the same over each image against the
    other distinct prompts (chance level);
    ``clip_accuracy`` is how often an image's own prompt is the most similar of the distinct prompts.
    """
    unique = sorted(set(prompts))
    similarity = image_features @ scorer.text_features(unique).T  # (images, distinct prompts)
    own = np.array([unique.index(p) for p in prompts])
    matched = similarity[np.arange(len(prompts)), own]
    result = {"clip_score": _clip_score(matched), "clip_cosine": float(matched.mean())}
    if len(unique) > 1:
        others = np.ones_like(similarity, dtype=bool)
        others[np.arange(len(prompts)), own] = False
        result["clip_score_mismatched"] = _clip_score(similarity[others])
        result["clip_accuracy"] = float((similarity.argmax(1) == own).mean())
    return result


CLIP_SCORE_PROTOCOL = ("max(mean(100 x cosine), 0) over the images, torchmetrics' CLIPScore (the mean clamped at "
                       "0, not each image's cosine)")


def _clip_score(cosines: np.ndarray) -> float:
    """:data:`CLIP_SCORE_PROTOCOL`, as torchmetrics' ``CLIPScore.compute``: ``max(score / n_samples, 0)``."""
    return float(max(100 * cosines.mean(), 0.0))


def evaluate(images, *, clip_model: str | None = None, reference=None, fid_features: str = "clip",
             inception_weights: str | None = None, batch_size: int = 32, device=None, judge: bool = False,
             protocol: dict | None = None, cmmd_estimator: str = "biased", models: tuple | None = None,
             reference_set: tuple | None = None) -> dict:
    """Score ``images`` (paths, or a list of ``(PIL image, prompt)`` pairs) and return the metrics.

    A prompt is text or a GenEval metadata line (a dict with ``prompt``). CLIP metrics need prompts
    (images without one are left out of them) and ``clip_model``; FID and CMMD need ``reference``;
    ``judge`` adds the scene judge's per-category accuracy; ``cmmd_estimator``: "biased" (the CMMD
    reference code's, comparable with published numbers) or "unbiased". The result's ``protocol`` records how the
    numbers were made: ``protocol`` (the sampling settings, when the images were generated) and the
    feature models and resizing used here. ``models`` (:func:`feature_models`) and ``reference_set``
    (:func:`reference_features`): those already loaded and read, before the images were generated.
    """
    from diffusion.sample import cmmd, judge as scene_judge
    if not clip_model and not judge:
        raise ValueError("nothing to compute: give a CLIP model (CLIP score, FID, CMMD) or judge=True")
    scorer, inception = models or feature_models(clip_model, fid_features, inception_weights, device)
    skipped = collections.Counter()
    pairs = iter_images(images, skipped) if _is_paths(images) else iter(images)
    clip_feats, fid_feats, prompts, judged, unjudged = [], [], [], [], 0
    for batch in _batches(pairs, batch_size):
        batch_images = [im for im, _ in batch]
        if scorer:
            clip_feats.append(scorer.image_features(batch_images))
            fid_feats.append(clip_feats[-1] if inception is None else inception(batch_images))
        if judge:
            results, missed = scene_judge.judge_many(batch)
            judged.extend(results)
            unjudged += missed
        prompts.extend(p["prompt"] if isinstance(p, dict) else p for _, p in batch)
    if not prompts:
        raise InputError(f"no readable images in {images!r}" + _first_reason(skipped))
    result = {"num_images": len(prompts), "protocol": _protocol(protocol, len(prompts), scorer, clip_model,
                                                                 inception, judge, cmmd_estimator)}
    if scorer:
        result["fid_features"] = result["protocol"]["fid_features"]
    if judge:
        result["judge"] = {**scene_judge.summarize(judged), "unjudged": unjudged}
    prompted = [i for i, p in enumerate(prompts) if p]
    if prompted and scorer:
        result.update(clip_metrics(np.concatenate(clip_feats)[prompted], [prompts[i] for i in prompted], scorer))
    if reference is not None and not scorer:
        raise ValueError("FID and CMMD against a reference set need a CLIP model (--clip-model)")
    if reference is not None and len(prompts) < MIN_FID_IMAGES:  # known before reading the reference
        result["fid_skipped"] = (f"FID needs at least {MIN_FID_IMAGES} images per set, got {len(prompts)}: "
                                 f"generate more (e.g. --images-per-prompt 8) for a FID")
    elif reference is not None:
        ref_clip, ref_fid, ref_skipped = reference_set or reference_features(reference, scorer, inception, batch_size)
        skipped.update(ref_skipped)
        result["protocol"]["reference_count"] = len(ref_fid)
        if len(ref_fid) < MIN_FID_IMAGES:
            result["fid_skipped"] = (f"FID needs at least {MIN_FID_IMAGES} images per set, the reference set has "
                                     f"{len(ref_fid)} readable: give more reference images for a FID")
        else:
            result.update(num_reference=len(ref_fid), fid=frechet_distance(np.concatenate(fid_feats), ref_fid),
                          cmmd=cmmd.cmmd(np.concatenate(clip_feats), ref_clip, cmmd_estimator))
    if skipped:
        result["skipped"] = dict(skipped)
    return result


def _first_reason(skipped: collections.Counter) -> str:
    """``: <the first reason an image was skipped>`` (and how many more), or nothing."""
    if not skipped:
        return ""
    reason = next(iter(skipped))
    return f": {reason}" + (f" (and {sum(skipped.values()) - skipped[reason]} more skipped)"
                            if sum(skipped.values()) > skipped[reason] else "")


def _protocol(given: dict | None, count: int, scorer, clip_model, inception, judge: bool,
              cmmd_estimator: str = "biased") -> dict:
    """How the numbers were made: the sampling settings (``given``; "given images" when the images were
    not generated here), the image count, each feature model and the resizing in front of it: ``feature_model``
    and ``resize`` CLIP's (CLIP score, CMMD), ``fid_feature_model`` and ``fid_resize`` FID's (CLIP's again unless
    ``fid_features`` is inception)."""
    from diffusion.sample import cmmd, judge as scene_judge
    protocol = dict(given or {"images": "given (not generated by this command)"})
    protocol["image_count"] = count
    if scorer:
        processor = scorer.processor
        protocol["feature_model"] = clip_model
        protocol["resize"] = (f"CLIPImageProcessor: shortest side to {processor.size}, resample "
                              f"{int(processor.resample)} (PIL), centre crop {processor.crop_size}")
        protocol["clip_score"] = CLIP_SCORE_PROTOCOL
        protocol["fid_features"] = "clip" if inception is None else "inception"
        protocol["fid_feature_model"] = clip_model if inception is None else \
            f"torchvision Inception-v3 2048-d pool features, weights {inception.weights}"
        protocol["fid_resize"] = protocol["resize"] if inception is None else inception.resize
        protocol["cmmd"] = cmmd.protocol(cmmd_estimator)
    if judge:
        protocol["judge"] = (f"diffusion.sample.judge: centre square, bilinear down to {scene_judge.WORK_SIDE} px "
                             f"when larger; GenEval's metadata rules")
    return protocol


# ---- prompt adherence on the procedural sample scenes (the demo's score) -----------------------------

def dominant_color(image, palette: dict, background: dict) -> str:
    """The ``palette`` colour covering most pixels of ``image``.

    Each pixel goes to its nearest colour among ``palette`` and ``background``; background colours
    absorb pixels but never win, and pixels far from everything don't vote.
    """
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32).reshape(-1, 3)
    names = list(palette) + list(background)
    centres = np.array([{**palette, **background}[n] for n in names], dtype=np.float32)
    distance = np.linalg.norm(pixels[:, None, :] - centres[None, :, :], axis=-1)
    nearest = distance.argmin(1)[distance.min(1) < 90.0]
    votes = np.bincount(nearest, minlength=len(names))[: len(palette)]
    return names[int(votes.argmax())]


def prompt_color(prompt: str) -> str:
    """The sample-scene colour a prompt names ("an orange square" → "orange")."""
    from diffusion.kit.sample import COLORS
    named = [word for word in prompt.lower().split() if word in COLORS]
    if not named:
        raise ValueError(f"prompt {prompt!r} names none of the scene colours {sorted(COLORS)}")
    return named[0]


def prompt_adherence(images, prompts) -> float:
    """Fraction of images whose dominant colour is the one their prompt names (chance: one over the
    number of distinct colours the prompts name)."""
    from diffusion.kit.sample import BACKGROUNDS, COLORS
    palette = {c: COLORS[c] for c in sorted({prompt_color(p) for p in prompts})}
    background = {f"bg-{n}": v for n, v in BACKGROUNDS.items()}
    background.update({c: v for c, v in COLORS.items() if c not in palette})
    hits = [dominant_color(image, palette, background) == prompt_color(prompt)
            for image, prompt in zip(images, prompts)]
    return sum(hits) / len(hits)


def _is_paths(value) -> bool:
    if isinstance(value, (str, os.PathLike)):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, (str, os.PathLike)) for v in value)


def save_images(images, prompts, directory: str) -> None:
    """Write ``00000.png`` + ``00000.txt`` (its prompt) per image, the layout :func:`iter_images` reads."""
    os.makedirs(directory, exist_ok=True)
    for i, (image, prompt) in enumerate(zip(images, prompts)):
        image.save(os.path.join(directory, f"{i:05d}.png"))
        with open(os.path.join(directory, f"{i:05d}.txt"), "w") as f:
            f.write(prompt)


DESCRIPTION = """Score images: CLIP score against their prompts, FID and CMMD against a reference set, and
(--judge) the sample scenes' composition in GenEval's six categories.

Input: images (--images: prompt grids from diffusion.generate, images with NAME.txt captions, raw-data
parquet or webdataset tars, or directories of these), or a checkpoint and prompts to generate them
(--checkpoint with --prompts-file, and the sampling flags of diffusion.generate); a CLIP model
(--clip-model: local directory or hub id); for FID and CMMD a reference set (--reference, the same
forms). FID features are the CLIP model's image embeddings unless --fid-features inception; CMMD's are
always CLIP's (sigma 10, x1000, the reference code's biased estimator; --cmmd-estimator unbiased for the
U-statistic). --judge needs no CLIP model: it reads shapes, colours, counts
and places back from the images and scores them against their prompts (captions of the sample scenes,
or GenEval metadata lines: --prompts-file X.jsonl, a GenEval image folder as --images).
Output: the metrics as JSON on stdout (and in --out): num_images, clip_score, clip_accuracy, fid, cmmd,
judge (per-category accuracy), and protocol (sampler, steps, guidance, seed, image count, size, each
metric's feature model and resizing). CLIP score is torchmetrics' CLIPScore: max(mean(100 x cosine), 0)."""
EXAMPLES = """examples:
  python -m diffusion.kit --preset tiny-clip --out .cache/kit/tiny-clip   # an offline CLIP for trying it
  python -m diffusion.evaluate --images grid.png --reference out/demo/raw --clip-model .cache/kit/tiny-clip
  python -m diffusion.evaluate --checkpoint ckpt/latest-rank0.pt --prompts-file prompts.txt \\
      --images-per-prompt 8 --reference coco/ --clip-model openai/clip-vit-large-patch14 --out metrics.json
  python -m diffusion.kit.scenes --out heldout.jsonl     # held-out prompts in GenEval's six categories
  python -m diffusion.evaluate --checkpoint ckpt/latest-rank0.pt --prompts-file heldout.jsonl \\
      --images-per-prompt 4 --judge --save-images out/geneval --out judged.json
  python -m diffusion.evaluate --images out/geneval --judge    # a GenEval image folder, judged again
  python -m diffusion.evaluate --checkpoint out/exported/ --prompts-file dpg_bench/prompts \\
      --images-per-prompt 4 --save-images out/dpg --clip-model openai/clip-vit-large-patch14   # DPG-Bench's layout"""


def build_parser() -> argparse.ArgumentParser:
    from diffusion.sample import generate
    parser = argparse.ArgumentParser(prog="python -m diffusion.evaluate", description=DESCRIPTION,
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", nargs="+", default=None, metavar="PATH",
                        help="images to score: grids, image files, parquet/tar files or directories")
    parser.add_argument("--reference", nargs="+", default=None, metavar="PATH",
                        help="reference images for FID (same forms; default: no FID)")
    parser.add_argument("--clip-model", default=None, metavar="REF",
                        help="CLIP model: local directory or hub id (transformers.CLIPModel); needed for CLIP "
                             "score, FID and CMMD")
    parser.add_argument("--judge", action="store_true",
                        help="judge the sample scenes' composition in GenEval's six categories (no CLIP model "
                             "needed)")
    parser.add_argument("--fid-features", choices=("clip", "inception"), default="clip",
                        help="features FID compares (default: %(default)s)")
    parser.add_argument("--cmmd-estimator", choices=("biased", "unbiased"), default="biased",
                        help="CMMD's estimator: biased, google-research/cmmd's, which published numbers use "
                             "(default), or unbiased (the within-set means without the diagonal)")
    parser.add_argument("--inception-weights", default=None, metavar="FILE",
                        help="local torchvision Inception-v3 state dict, for --fid-features inception")
    parser.add_argument("--eval-batch-size", type=cli.positive_int, default=32,
                        help="images per feature batch (default: %(default)s)")
    parser.add_argument("--prompts-file", default=None, metavar="FILE",
                        help="with --checkpoint: prompts to generate, one a line; or .jsonl of GenEval metadata "
                             "lines (python -m diffusion.kit.scenes, GenEval's evaluation_metadata.jsonl); or a "
                             "directory of ID.txt prompts (DPG-Bench's dpg_bench/prompts)")
    parser.add_argument("--save-images", default=None, metavar="DIR",
                        help="with --checkpoint: keep the generated images here (NNNNN.png + NNNNN.txt; with a "
                             ".jsonl prompts file GenEval's layout, NNNNN/metadata.jsonl + NNNNN/samples/NNNN.png; "
                             "with a prompts directory DPG-Bench's, ID.png: the prompt's images tiled 2x2)")
    parser.add_argument("--out", default=None, metavar="JSON", help="also write the metrics to this JSON file")
    generate.add_sampling_args(parser)
    return parser


def _check_inputs(paths, flag: str) -> None:
    for path in paths or ():
        if "://" not in path and not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, f"no such file or directory (given as {flag})", path)


def _check_clip_model(ref: str) -> None:
    """A local CLIP directory must exist and hold a config; anything else must look like a hub id."""
    if os.path.isdir(os.path.expanduser(ref)):
        if not os.path.exists(os.path.join(os.path.expanduser(ref), "config.json")):
            raise InputError(f"--clip-model {ref}: a directory without config.json, so no transformers "
                             f"CLIPModel (`python -m diffusion.kit --preset tiny-clip --out DIR` writes one)")
        return
    if ref.startswith((".", "/", "~")) or ref.count("/") != 1 or os.path.exists(ref):
        raise FileNotFoundError(errno.ENOENT, "no such directory, and not a hub id owner/name (given as "
                                              "--clip-model)", ref)


def main(argv=None) -> None:
    from diffusion.sample import generate
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.clip_model and not args.judge:
        parser.error("give --clip-model (CLIP score, FID, CMMD), --judge, or both")
    if args.reference and not args.clip_model:
        parser.error("--reference (FID, CMMD) needs --clip-model")
    if bool(args.images) == bool(args.checkpoint):
        parser.error("give either --images or --checkpoint with --prompts-file")
    if args.checkpoint and not args.prompts_file:
        parser.error("--checkpoint needs --prompts-file")
    if args.images and (args.prompts_file or args.save_images):
        parser.error("--prompts-file and --save-images go with --checkpoint, not --images")
    dpg = bool(args.prompts_file) and os.path.isdir(args.prompts_file)
    if dpg and args.images_per_prompt > dpg_layout.MAX_IMAGES:
        parser.error(f"--prompts-file {args.prompts_file} is DPG-Bench's prompts directory: its evaluator reads at "
                     f"most {dpg_layout.MAX_IMAGES} images a prompt (a 2x2 grid), not --images-per-prompt "
                     f"{args.images_per_prompt}")
    # Everything the user named is checked before a model loads or an image is generated.
    if args.checkpoint:
        generate.check_sampling_args(args)
    _check_inputs(args.images, "--images")
    _check_inputs(args.reference, "--reference")
    if args.clip_model:
        _check_clip_model(args.clip_model)
    if args.fid_features == "inception":
        if not args.inception_weights:
            parser.error("--fid-features inception needs --inception-weights FILE")
        _check_inputs([args.inception_weights], "--inception-weights")
    if args.out:
        generate.check_output_file(args.out, None, "--out")
    if args.save_images and os.path.exists(args.save_images) and not os.path.isdir(args.save_images):
        raise NotADirectoryError(errno.ENOTDIR, "--save-images is a file; give a folder for the generated images",
                                 args.save_images)  # before any image is generated, not after
    if args.save_images and os.path.isdir(args.save_images) and os.listdir(args.save_images):
        held = sorted(os.listdir(args.save_images))  # an earlier run's 00007.png would be read as one of these
        raise UserError(f"--save-images {args.save_images} already holds {len(held)} "
                        f"{'entry' if len(held) == 1 else 'entries'} (e.g. {held[0]}): give "
                        f"a new or empty folder, so that it holds exactly this run's images")
    images, protocol, models, reference_set = args.images, None, None, None
    if args.checkpoint:
        lines = geneval_layout.read_metadata(args.prompts_file) if args.prompts_file.endswith(".jsonl") else None
        ids = dict(dpg_layout.read_prompts(args.prompts_file)) if dpg else None
        prompts = ([line["prompt"] for line in lines] if lines else list(ids.values()) if ids
                   else generate.read_prompts(args.prompts_file))
        kwargs = generate.sample_kwargs(args)
        # the feature models load, and the reference set is read, before any image is generated: either may be refused
        models = feature_models(args.clip_model, args.fid_features, args.inception_weights, args.device)
        if args.reference:
            reference_set = reference_features(args.reference, *models, args.eval_batch_size)
        protocol = {"images": "generated", "checkpoint": args.checkpoint, "ema": args.ema,
                    "steps": args.steps, "guidance_scale": args.guidance_scale,
                    "guidance_rescale": args.guidance_rescale, "negative_prompt": args.negative_prompt,
                    "seed": args.seed, "images_per_prompt": args.images_per_prompt, "prompts": len(prompts),
                    "prompts_file": args.prompts_file}
        generated = generate.generate_images(args.checkpoint, prompts, protocol=protocol, **kwargs)
        labels = [p for p in (lines or prompts) for _ in range(args.images_per_prompt)]
        if args.save_images and lines:
            geneval_layout.write_layout(args.save_images, generated, lines, args.images_per_prompt)
        elif args.save_images and ids:
            dpg_layout.write_layout(args.save_images, generated, list(ids), args.images_per_prompt)
        elif args.save_images:
            save_images(generated, labels, args.save_images)
        images = list(zip(generated, labels))
    metrics = evaluate(images, clip_model=args.clip_model, reference=args.reference,
                       fid_features=args.fid_features, inception_weights=args.inception_weights,
                       batch_size=args.eval_batch_size, device=args.device, judge=args.judge, protocol=protocol,
                       cmmd_estimator=args.cmmd_estimator, models=models, reference_set=reference_set)
    text = json.dumps(metrics, indent=2, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    if "judge" in metrics:
        judged = metrics["judge"]
        print("evaluate: judge: " + ", ".join(f"{t} {a:.0%} ({judged['images'][t]})" for t, a in judged["accuracy"].items())
              + (f"; overall {judged['overall']:.0%}" if judged["overall"] is not None else "")
              + (f"; {judged['unjudged']} images with prompts it cannot read" if judged["unjudged"] else ""),
              file=sys.stderr)
    if "fid_skipped" in metrics:
        print(f"evaluate: no FID: {metrics['fid_skipped']}", file=sys.stderr)


if __name__ == "__main__":
    cli.run(main, "evaluate")
