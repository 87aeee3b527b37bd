"""Curation from the pixels (``--embed``): image and caption embeddings, scores computed from them, and
``--where`` on those scores, as one more stage of the conversion's Ray job.

    read -> ImageCaptionTransform [-> Recaptioner] -> Curator -> LatentTextEncoder -> MDSPartSink

:class:`Curator` is a Ray Data ``map_batches`` callable (a class: the models load once per actor). It
reads the transform's uint8 crop (the largest resolution, or each row's bucket crop), so no image is
decoded twice, and adds per row:

- ``clip_score``: the cosine of the image embedding and the caption's text embedding, as LAION-5B
  computed it (it kept pairs >= 0.28 with CLIP ViT-B/32);
- one score per head given (``--aesthetic-head`` -> ``aesthetic_score``, ``--nsfw-head`` -> ``nsfw``,
  ``--watermark-head`` -> ``watermark``): a small MLP on the image embedding (L2-normalised unless the
  head's metadata says ``normalize=false``), read from a safetensors file (:class:`Head`; never a pickle);
- with ``--store-embeddings``, the image embedding itself (``clip_embeds``, float16).

Scores are stored as MDS columns (float32) and can be filtered on with ``--where``, in the same grammar
as the input's metadata columns: the ``--where`` is split by its top-level ``and`` rules
(:func:`split_where`); rules on the input's columns are decided as the parquet is read (before any
decode), rules on computed scores right after this stage (before the VAE), each rule's removals counted
under ``filtered: RULE``. The written rows' score histograms are kept in each part's stats
(:data:`HISTOGRAMS`), summed into ``dataset.json`` and the summary.

The embedding model is any transformers model with ``get_image_features`` and ``get_text_features``
(CLIP, SigLIP), found by the same function that finds every transformers model
(:func:`diffusion.models.loading.resolve_captioner`: a hub id or a local directory) and loaded from
safetensors only (``use_safetensors``; a config asking for remote code is refused).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from diffusion.errors import ConfigError, ModelReferenceError

EMBEDS = "clip_embeds"  # the stored image embedding (--store-embeddings)
CLIP_SCORE = "clip_score"
HEAD_COLUMNS = {"aesthetic": "aesthetic_score", "nsfw": "nsfw", "watermark": "watermark"}
SCORES = (CLIP_SCORE, *HEAD_COLUMNS.values())
CURATED_COLUMNS = (*SCORES, EMBEDS)  # what the encode stage carries through to the sink
STAGE_SECONDS = "_curate_seconds"
REUSED_SECONDS = "_curate_reused_seconds"  # rows whose scores came from --dedupe near/semantic's first pass
NON_FINITE_SCORE = "non_finite_score"  # a row whose computed score is NaN or infinite: rejected, never written
# Per score column: (low, high, bins) of its histogram in the parts' stats; values outside fall in the end bins.
HISTOGRAMS = {CLIP_SCORE: (-0.2, 0.6, 16), "aesthetic_score": (0.0, 10.0, 20), "nsfw": (0.0, 1.0, 10),
              "watermark": (0.0, 1.0, 10)}
HIST_PREFIX = "hist:"  # stats record names: "hist:<column>:<bin>"
# A head's settings when its safetensors metadata does not say: LAION's aesthetic predictor is a
# stack of Linear layers without activations (a linear map in effect) giving a 1-10 rating; the
# safety heads end in a sigmoid (a probability). All read the L2-normalised image embedding.
HEAD_DEFAULTS = {"aesthetic": {"activation": "none", "output": "identity", "normalize": "true"},
                 "nsfw": {"activation": "relu", "output": "sigmoid", "normalize": "true"},
                 "watermark": {"activation": "relu", "output": "sigmoid", "normalize": "true"}}
_ACTIVATIONS = ("none", "relu", "gelu")
_OUTPUTS = ("identity", "sigmoid")


# ---- --where on computed columns -----------------------------------------------------------------

def split_where(text: str | None, computed) -> tuple[str | None, str | None]:
    """(the rules on the input's metadata, the rules on ``computed`` columns) of a ``--where``, each as
    a filter text (None where it has none). A rule is a top-level ``and`` term; one that mixes both
    kinds (``clip_score > 0.3 or aesthetic > 5``) cannot be decided at either point and is refused."""
    if not text:
        return None, None
    from diffusion.where import parse_where
    computed = set(computed)
    meta, scores = [], []
    for rule, _ in parse_where(text).rules:
        columns = set(parse_where(rule).columns)
        if columns & computed and columns - computed:
            raise ConfigError(f"--where rule {rule!r} mixes computed scores ({', '.join(sorted(columns & computed))}) "
                              f"with input columns ({', '.join(sorted(columns - computed))}): the input's are decided "
                              f"before decoding, the scores after embedding; write them as separate 'and' rules")
        (scores if columns & computed else meta).append(rule)
    return (" and ".join(meta) or None), (" and ".join(scores) or None)


def check_score_types(where: str) -> None:
    """ConfigError in one line if ``where`` (the rules on computed scores, :func:`split_where`) cannot be
    evaluated on them (float32: a score compared with text), before any cluster work, as a rule on the
    input's columns is checked against its files (it was the curation actors' Arrow traceback)."""
    import pyarrow as pa
    from diffusion.where import parse_where
    row_filter = parse_where(where)
    row_filter.check_types(pa.schema([(c, pa.float32()) for c in row_filter.columns]), "the computed scores")


# ---- heads ---------------------------------------------------------------------------------------

class Head:
    """A score from an image embedding: Linear layers (``layers.<i>.weight`` / ``.bias`` in a safetensors
    file, applied in index order, LAION's aesthetic-predictor layout; a single ``weight`` / ``bias`` is a
    linear probe), an activation between them and an output function, from the file's metadata
    (``activation``: none, relu, gelu; ``output``: identity, sigmoid; ``normalize``: true to read the
    L2-normalised embedding), defaults per head kind (:data:`HEAD_DEFAULTS`)."""

    def __init__(self, path: str, kind: str, width: int | None = None, flag: str | None = None):
        import torch
        from safetensors import safe_open
        flag = flag or f"--{kind}-head"
        where = f"{flag} {path}"
        if not os.path.isfile(path):
            raise ConfigError(f"{where}: no such file")
        if not path.endswith(".safetensors"):
            raise ConfigError(f"{where}: a head is read from a .safetensors file only (a pickle can run code when "
                              f"loaded); convert it once with safetensors' save_file")
        try:
            with safe_open(path, framework="pt") as f:
                meta = dict(f.metadata() or {})
                tensors = {k: f.get_tensor(k).float() for k in f.keys()}
        except Exception as e:
            raise ConfigError(f"{where} is not a safetensors file ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                              ) from None
        self.settings = {**HEAD_DEFAULTS[kind], **{k: str(v) for k, v in meta.items() if k in HEAD_DEFAULTS[kind]}}
        if self.settings["activation"] not in _ACTIVATIONS or self.settings["output"] not in _OUTPUTS:
            raise ConfigError(f"{where}: metadata activation={self.settings['activation']!r} output="
                              f"{self.settings['output']!r}; expected one of {_ACTIVATIONS} and {_OUTPUTS}")
        for name, tensor in sorted(tensors.items()):  # a NaN weight gives every row a NaN score
            if not bool(torch.isfinite(tensor).all()):
                raise ConfigError(f"{where}: tensor {name!r} holds non-finite values (NaN or inf); a head's weights "
                                  f"must all be finite numbers")
        self.layers = self._layers(tensors, where)
        self.width = int(self.layers[0][0].shape[1])
        if width is not None and self.width != int(width):
            raise ConfigError(f"{where} reads {self.width}-wide embeddings, but the --embed model's are {width} wide: "
                              f"use a head made for that model")
        if self.settings["normalize"].lower() not in ("true", "false"):
            raise ConfigError(f"{where}: metadata normalize={self.settings['normalize']!r}; expected true (read the "
                              f"L2-normalised embedding) or false (the model's features as they come)")
        self.normalize = self.settings["normalize"].lower() == "true"
        self._torch = torch

    @staticmethod
    def _layers(tensors: dict, where: str) -> list:
        if set(tensors) == {"weight", "bias"}:
            pairs = [(tensors["weight"], tensors["bias"])]
        else:
            index = {}
            for name in tensors:
                parts = name.split(".")
                if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or parts[2] not in ("weight", "bias"):
                    raise ConfigError(f"{where}: tensor {name!r} is not layers.<i>.weight/bias (the LAION "
                                      f"aesthetic predictor's layout) nor a single weight/bias")
                index.setdefault(int(parts[1]), {})[parts[2]] = tensors[name]
            pairs = []
            for i in sorted(index):
                if set(index[i]) != {"weight", "bias"}:
                    raise ConfigError(f"{where}: layer {i} lacks its weight or bias")
                pairs.append((index[i]["weight"], index[i]["bias"]))
        if not pairs:
            raise ConfigError(f"{where} holds no layers")
        for i, (w, b) in enumerate(pairs):
            if w.ndim != 2 or b.shape != (w.shape[0],) or (i and w.shape[1] != pairs[i - 1][0].shape[0]):
                raise ConfigError(f"{where}: layer {i}'s shapes {tuple(w.shape)}, {tuple(b.shape)} do not chain")
        if pairs[-1][0].shape[0] != 1:
            raise ConfigError(f"{where}: the last layer gives {pairs[-1][0].shape[0]} values; a head gives one score")
        return pairs

    def __call__(self, embeddings: np.ndarray) -> np.ndarray:
        torch = self._torch
        x = torch.as_tensor(np.asarray(embeddings, np.float32))
        if self.normalize:
            x = torch.nn.functional.normalize(x, dim=-1)
        act = self.settings["activation"]
        for i, (w, b) in enumerate(self.layers):
            x = x @ w.T + b
            if i < len(self.layers) - 1 and act != "none":
                x = torch.relu(x) if act == "relu" else torch.nn.functional.gelu(x)
        if self.settings["output"] == "sigmoid":
            x = torch.sigmoid(x)
        return x[:, 0].numpy().astype(np.float32)


def save_head(path: str, layers: list, kind: str, **metadata) -> None:
    """Write a head (``[(weight, bias), ...]`` tensors) as :class:`Head` reads it."""
    from safetensors.torch import save_file
    tensors = {}
    for i, (w, b) in enumerate(layers):
        tensors[f"layers.{i}.weight"] = w.detach().float().contiguous()
        tensors[f"layers.{i}.bias"] = b.detach().float().contiguous()
    save_file(tensors, path, metadata={**HEAD_DEFAULTS[kind], **{k: str(v) for k, v in metadata.items()}})


# ---- the embedding model -------------------------------------------------------------------------

def check_embedder(ref: str) -> tuple[str, int]:
    """(local directory, embedding width) of ``--embed ref``, refused in one line before any actor starts
    where loading would fail or could run code (no safetensors, remote code, no image and text towers)."""
    from diffusion.models import loading
    try:
        path = loading.resolve_captioner(ref)
    except ModelReferenceError as e:
        raise ModelReferenceError(f"--embed: {str(e).replace('captioning model', 'model')}") from None
    where = f"--embed {ref}"
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelReferenceError(f"{where}: config.json does not load ({type(e).__name__})") from None
    if "auto_map" in config:
        raise ModelReferenceError(f"{where}: config.json asks for the model's own code (auto_map), which is never run")
    if not any(n.endswith(".safetensors") for n in os.listdir(path)):
        raise ModelReferenceError(f"{where} holds no .safetensors weights (pickled weights can run code when loaded)")
    if "vision_config" not in config or "text_config" not in config:
        raise ModelReferenceError(f"{where}: {config.get('model_type')!r} is not an image-text model with both towers "
                                  f"(CLIP, SigLIP)")
    width = config.get("projection_dim") or config["vision_config"].get("hidden_size")
    return path, int(width)


class ClipEmbedder:
    """A CLIP-style model's normalised image and text embeddings, on CUDA in bf16/fp16 when visible, else CPU fp32."""

    def __init__(self, ref: str, device=None):
        import torch
        from transformers import AutoModel, AutoTokenizer
        from diffusion.models.text_encoder import pick_device_and_dtype
        path, self.width = check_embedder(ref)
        self.device, self.dtype = pick_device_and_dtype(device)
        self.model = AutoModel.from_pretrained(path, dtype=self.dtype, use_safetensors=True).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        vision = self.model.config.vision_config
        self.size = int(vision.image_size)
        mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]  # CLIP's
        processor = os.path.join(path, "preprocessor_config.json")
        if os.path.isfile(processor):
            with open(processor) as f:
                saved = json.load(f)
            mean, std = saved.get("image_mean", mean), saved.get("image_std", std)
        self.mean = torch.tensor(mean, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=self.device).view(1, 3, 1, 1)
        text = self.model.config.text_config
        self.max_length = min(int(getattr(text, "max_position_embeddings", 77) or 77), 77)
        self._torch = torch

    def _normalised(self, features):
        features = getattr(features, "pooler_output", features)  # transformers 5 may return a model output
        return self._torch.nn.functional.normalize(features.float(), dim=-1).cpu().numpy()

    def images(self, crops: list[np.ndarray]) -> np.ndarray:
        """(B, D) float32 unit vectors of uint8 HWC crops (:meth:`image_features`, L2-normalised)."""
        return unit_vectors(self.image_features(crops))

    def image_features(self, crops: list[np.ndarray]) -> np.ndarray:
        """(B, D) float32 projected image features of uint8 HWC crops, as the model gives them (not
        normalised: a head whose metadata says ``normalize=false`` reads these), each crop resized to the
        tower's size (a square crop is what CLIP's processor makes of it too)."""
        torch = self._torch
        if not crops:
            return np.zeros((0, self.width), np.float32)
        with torch.inference_mode():
            # one copy, writable (the crops are the object store's read-only views: torch warns on those)
            x = torch.from_numpy(np.stack(_same_size(crops))).permute(0, 3, 1, 2).to(self.device).float().div(255.0)
            if x.shape[-1] != self.size or x.shape[-2] != self.size:
                x = torch.nn.functional.interpolate(x, size=(self.size, self.size), mode="bicubic", antialias=True,
                                                    align_corners=False).clamp(0, 1)
            x = ((x - self.mean) / self.std).to(self.dtype)
            features = self.model.get_image_features(pixel_values=x)
            features = getattr(features, "pooler_output", features)  # transformers 5 may return a model output
            return features.float().cpu().numpy()

    def texts(self, captions) -> np.ndarray:
        torch = self._torch
        captions = [str(c) for c in captions]
        if not captions:
            return np.zeros((0, self.width), np.float32)
        tokens = self.tokenizer(captions, padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(self.device)
        with torch.inference_mode():
            kwargs = {"input_ids": tokens["input_ids"]}
            if "attention_mask" in tokens:
                kwargs["attention_mask"] = tokens["attention_mask"]
            return self._normalised(self.model.get_text_features(**kwargs))


def unit_vectors(x: np.ndarray) -> np.ndarray:
    """Each row of ``x`` scaled to unit length (torch's ``normalize``: a zero row stays zero)."""
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _same_size(crops: list[np.ndarray]) -> list[np.ndarray]:
    """Bucket crops differ in shape: each centre-cropped to its own square, resized to the first's side."""
    side = min(crops[0].shape[:2])
    out = []
    for c in crops:
        h, w = c.shape[:2]
        s = min(h, w)
        c = c[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
        if s != side:
            from PIL import Image
            c = np.asarray(Image.fromarray(c).resize((side, side), Image.BICUBIC))
        out.append(c)
    return out


# ---- perceptual vectors (--dedupe near) ------------------------------------------------------------

PERCEPTUAL_SIDE = 16  # the thumbnail's side: 16 x 16 x 3 = 768 values


def perceptual_vectors(crops: list[np.ndarray]) -> np.ndarray:
    """(B, 768) float32 unit vectors that near-duplicates share: a 16x16 YCbCr thumbnail made symmetric
    left-right (so a mirrored copy gives the same vector); its luma less its mean (brightness) and
    scaled to unit length (contrast), its chroma less grey (128) scaled to unit length (saturation),
    the two halves joined and normalised. Re-encoding, resizing and a small crop move a 16 px
    thumbnail little; two different scenes differ in it (measured: bench/bench_curation.py)."""
    from PIL import Image
    out = []
    for crop in _same_size(crops) if crops else []:
        a = np.asarray(Image.fromarray(crop).convert("YCbCr").resize((PERCEPTUAL_SIDE, PERCEPTUAL_SIDE), Image.BOX),
                       np.float32)
        a = (a + a[:, ::-1]) / 2.0
        luma = a[:, :, 0] - a[:, :, 0].mean()
        luma /= max(float(np.linalg.norm(luma)), 1e-6)
        chroma = a[:, :, 1:] - 128.0
        chroma /= max(float(np.linalg.norm(chroma)), 1e-6)
        v = np.concatenate([luma.ravel(), chroma.ravel()])
        out.append(v / max(float(np.linalg.norm(v)), 1e-6))
    return np.asarray(out, np.float32).reshape(len(out), 3 * PERCEPTUAL_SIDE ** 2)


# ---- the stage -------------------------------------------------------------------------------------

class Curator:
    """Ray ``map_batches`` callable: the transform's output in; the same columns plus the scores (and
    ``clip_embeds`` with ``store_embeddings``) out, rows failing ``where`` (on the scores) dropped and
    recorded in ``rejects_dir`` under their rule.

    ``reuse``: a first pass's ``curated.parquet`` (:func:`diffusion.convert.neardup.first_pass_scores`):
    a batch whose keys are all in it takes their scores and embeddings from it, the values the model
    gave for the same crop and caption, and the model is loaded only for a batch that is not (its
    timing is recorded apart, as ``curate_reused``)."""

    def __init__(self, embed: str | None, resolution: int, heads: dict | None = None, where: str | None = None,
                 rejects_dir: str | None = None, store_embeddings: bool = False, device=None,
                 cpu_threads: int | None = None, record_timing: bool = False, reuse: str | None = None):
        self.resolution, self.where, self.rejects_dir = int(resolution), where, rejects_dir
        self.store_embeddings, self.record_timing = store_embeddings, record_timing
        self.reuse = None
        self._model = (embed, heads, device, cpu_threads)
        if reuse:  # torch and the model are loaded only for a batch the first pass did not score
            self.reuse = FirstPassScores(reuse)
        else:
            self._load()

    def _load(self) -> None:
        import torch
        embed, heads, device, cpu_threads = self._model
        if cpu_threads:  # an actor holding a fraction of a CPU must not spawn one thread per core
            torch.set_num_threads(max(1, int(cpu_threads)))
        self.embedder = ClipEmbedder(embed, device) if embed else None
        width = self.embedder.width if self.embedder else None
        self.heads = {kind: Head(path, kind, width) for kind, path in (heads or {}).items() if path}
        self._model = None

    def scores(self, crops: list[np.ndarray], captions) -> tuple[dict, np.ndarray]:
        """({score column: (B,) float32}, (B, D) L2-normalised image embeddings) of one batch; the heads
        read the model's features, normalised or not as each one's metadata says."""
        if self._model is not None:  # reuse mode, a batch its first pass did not score
            self._load()
        features = self.embedder.image_features(crops)
        images = unit_vectors(features)
        texts = self.embedder.texts(captions)
        scores = {CLIP_SCORE: (images * texts).sum(axis=1).astype(np.float32)}
        for kind, head in self.heads.items():  # each normalises them as its metadata says (normalize)
            scores[HEAD_COLUMNS[kind]] = head(features)
        return scores, images

    def __call__(self, batch: dict) -> dict:
        from diffusion import schema
        start = time.perf_counter()
        keys = [str(k) for k in batch[schema.KEY]]
        found = self.reuse.get(keys) if self.reuse is not None else None
        if found is not None:
            scores, embeds = found
        else:
            from diffusion.convert.recaption import crops_of
            scores, images = self.scores(crops_of(batch, self.resolution), batch[schema.CAPTION])
            embeds = images.astype(np.float16) if self.store_embeddings else None
        out = dict(batch)
        out.update(scores)
        if self.store_embeddings:
            out[EMBEDS] = embeds
        keep = finite_rows(scores, keys, self.rejects_dir)
        if self.where and keep.any():
            rows = np.flatnonzero(keep)
            keep[rows] = failing_rows(self.where, {c: np.asarray(v)[rows] for c, v in scores.items()},
                                      [keys[i] for i in rows], self.rejects_dir)
        if not keep.all():
            out = {c: np.asarray(v)[keep] for c, v in out.items()}
        if self.record_timing:
            n = len(out[schema.KEY])
            share = np.full(n, (time.perf_counter() - start) / max(len(keys), 1))
            out[STAGE_SECONDS] = np.zeros(n) if found is not None else share
            if self.reuse is not None:  # both columns in every batch of this stage: its blocks share a schema
                out[REUSED_SECONDS] = share if found is not None else np.zeros(n)
        return out


def finite_rows(scores: dict, keys: list[str], rejects_dir: str | None) -> np.ndarray:
    """The rows whose every score is a finite number (a bool mask); the others (an embedding or a head
    that overflowed) are recorded in ``rejects_dir`` as :data:`NON_FINITE_SCORE`."""
    keep = np.ones(len(keys), bool)
    for values in scores.values():
        keep &= np.isfinite(np.asarray(values, np.float32))
    if not keep.all() and rejects_dir:
        from diffusion.rejects import write_rejects
        write_rejects(rejects_dir, {k: NON_FINITE_SCORE for k, ok in zip(keys, keep) if not ok})
    return keep


def failing_rows(where: str, scores: dict, keys: list[str], rejects_dir: str | None) -> np.ndarray:
    """The rows that pass ``where`` on ``scores`` (a bool mask); the others are recorded in ``rejects_dir``
    as ``filtered: RULE`` (the first rule each fails)."""
    import pyarrow as pa
    from diffusion.rejects import write_rejects
    from diffusion.where import parse_where
    row_filter = parse_where(where)
    table = pa.table({c: pa.array(v, pa.float32()) for c, v in scores.items() if c in row_filter.columns})
    blame = row_filter.blame(table)
    rejected = {k: row_filter.reason(b) for k, b in zip(keys, blame) if b is not None}
    if rejected and rejects_dir:
        write_rejects(rejects_dir, rejected)
    return np.array([b is None for b in blame], bool)


def histograms_of(counts: dict[str, dict[int, int]]) -> dict:
    """``{column: {"edges": [...], "counts": [...]}}`` from summed stats (``{column: {bin: count}}``)."""
    out = {}
    for column, bins in sorted(counts.items()):
        low, high, n = HISTOGRAMS[column]
        out[column] = {"edges": [round(low + (high - low) * i / n, 6) for i in range(n + 1)],
                       "counts": [int(bins.get(i, 0)) for i in range(n)]}
    return out


def histogram_lines(histograms: dict) -> list[str]:
    """One line per score for the summary table: its bins' counts between the end edges."""
    lines = []
    for column, h in histograms.items():
        lines.append(f"{column} [{h['edges'][0]:g}..{h['edges'][-1]:g}]: {' '.join(map(str, h['counts']))}")
    return lines


def curation_columns(computed, width: int | None, store_embeddings: bool) -> dict[str, str]:
    """The MDS columns --embed adds: each computed score (float32), and the embeddings when stored."""
    columns = {c: "float32" for c in computed}
    if store_embeddings:
        columns[EMBEDS] = f"ndarray:float16:{int(width)}"
    return columns


class FirstPassScores:
    """Each row's scores (and embedding) from a first pass's ``curated.parquet``, by key: a key's row
    group is found by the groups' first keys, and the last few groups read are kept (rows arrive in
    input-file order, so a batch's keys mostly fall in few groups)."""

    CACHED_GROUPS = 8

    def __init__(self, path: str):
        import pyarrow.parquet as pq
        self.file = pq.ParquetFile(path)
        self.firsts = json.loads(self.file.schema_arrow.metadata[b"first_keys"])
        self.columns = [c for c in self.file.schema_arrow.names if c != "key"]
        self.width = int(self.file.schema_arrow.metadata.get(b"width", b"0"))
        self.groups: dict[int, tuple[dict, dict]] = {}

    def _group(self, i: int) -> tuple[dict, dict]:
        if i not in self.groups:
            if len(self.groups) >= self.CACHED_GROUPS:
                self.groups.pop(next(iter(self.groups)))
            table = self.file.read_row_group(i)
            rows = {k: j for j, k in enumerate(table.column("key").to_pylist())}
            self.groups[i] = (rows, {c: table.column(c).to_pylist() if c == "embed" else
                                     table.column(c).to_numpy() for c in self.columns})
        return self.groups[i]

    def get(self, keys: list[str]) -> tuple[dict, np.ndarray | None] | None:
        """({score column: (B,) float32}, (B, D) float16 embeddings or None) of ``keys``, or None where a
        key is not in the file."""
        import bisect
        found = {c: [] for c in self.columns}
        for key in keys:
            i = bisect.bisect_right(self.firsts, key) - 1
            if i < 0:
                return None
            rows, values = self._group(i)
            j = rows.get(key)
            if j is None:
                return None
            for c in self.columns:
                found[c].append(values[c][j])
        embeds = None
        if "embed" in found:
            raw = found.pop("embed")
            embeds = (np.stack([np.frombuffer(b, np.float16) for b in raw]) if raw else
                      np.zeros((0, self.width), np.float16))
        return {c: np.asarray(v, np.float32) for c, v in found.items()}, embeds
