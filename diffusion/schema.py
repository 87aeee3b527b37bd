"""The data contract: MDS columns written by the converter and read by training, and batch keys.

Every module imports names from here; no column name or batch key is spelt as a literal elsewhere.

MDS columns (one row per image-caption pair):

| column              | encoding                    | meaning                                            |
|---------------------|-----------------------------|----------------------------------------------------|
| ``vae_moments_{R}`` | ``ndarray:float16:2C,R/f,R/f`` | VAE posterior mean (C ch) and log-variance (C ch) |
| ``vae_latents_{R}`` | ``ndarray:float16:C,R/f,R/f`` | instead, an autoencoder's deterministic latents (DC-AE) |
| ``text_embeds``     | ``ndarray:float16:77,D``    | text encoder last hidden state (``--text embeds``) |
| ``input_ids``       | ``ndarray:int32:77``        | CLIP token ids (``--text ids``)                    |
| ``text_tokens``     | ``int``                     | the caption's token count before padding: its attention mask |
| ``pooled_text_embeds`` | ``ndarray:float16:P``    | a second text encoder's pooled vector (Flux: CLIP's, beside T5's sequence) |
| ``caption``/``key`` | ``str``                     | the caption, a stable id of the source row         |
| ``width``/``height``| ``int``                     | original image size                                |
| ``crop_top``/``crop_left`` | ``int``              | bucket datasets only: the crop's corner in the resized image |
| ``caption_{N}``     | ``str``                     | ``--captions``: the input's caption column N ("" if empty) |
| ``text_embeds_{N}``/``input_ids_{N}``/``text_tokens_{N}`` | as above | caption N encoded as the first caption is |
| ``caption_recaption`` etc. | as above  | ``--recaption``: the caption an image-to-text model wrote, one more caption (``--recaption-column`` names it) |

With ``--buckets`` the output root holds one such dataset per aspect-ratio bucket (``bucket-<W>x<H>/``,
each with its own ``dataset.json``) and a root ``dataset.json`` whose ``buckets`` lists them with their
counts; there ``vae_moments_{R}`` is ``8,H/f,W/f`` of the bucket, R naming the pixel budget R x R.

With ``--captions caption,N,...`` the dataset holds several captions per image: the first (``caption``,
from ``--caption-column``) as always, and each further input column N in ``caption_{N}`` with its own
text columns (:func:`caption_columns`); ``dataset.json`` lists them in ``captions`` and counts their
empty values in ``empty_captions``. Training draws one per sample and epoch (``data.train.captions``).

The text length (77 above) is CLIP's context; ``--text-length`` sets another (e.g. 256 for a T5 text
encoder), recorded as ``dataset.json``'s ``text_length``. ``text_tokens`` (in datasets written since
token counts were stored; ``dataset.json`` then has ``empty_text_tokens``) gives each caption's attention
mask, ``arange(L) < text_tokens``, for embeddings and ids alike.

``C`` and ``f`` are the autoencoder's latent channels and downsampling factor (4 and 8 for SD2's VAE; 16
and 8 for SD3's and Flux's; 32 and 32 for DC-AE): ``dataset.json`` records them with the autoencoder class,
its scaling and shift factors and which of the two columns it holds (:class:`LatentSpace`). Which text columns a dataset holds is its
*text storage* (:data:`TEXT_STORAGE`, the converter's ``--text``): ``embeds`` (the text encoder's output,
≈158 KB a sample at SD2 size), ``ids`` (the 77 token ids, 308 bytes: training runs the frozen text
encoder on them) or ``both``; a ``dataset.json`` without the field is ``both`` (what every dataset
held before the choice existed). Beside ``index.json`` the converter writes ``dataset.json``
(:class:`DatasetInfo`) and ``empty_text_embeds.npy``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# ---- MDS columns -------------------------------------------------------------------------------
TEXT_EMBEDS = "text_embeds"
INPUT_IDS = "input_ids"
TEXT_TOKENS = "text_tokens"  # int: the caption's tokens before the padding (its attention mask)
# (P,) float16: the pooled vector of a model reference's second text encoder (Flux's layout: CLIP in text_encoder/
# pooled, beside T5's sequence from text_encoder_2/ in text_embeds); only in datasets of such a reference
POOLED_TEXT_EMBEDS = "pooled_text_embeds"
CAPTION = "caption"
KEY = "key"
WIDTH = "width"
HEIGHT = "height"
_VAE_MOMENTS_PREFIX = "vae_moments_"
_VAE_LATENTS_PREFIX = "vae_latents_"  # deterministic latents (AutoencoderDC): C channels, no posterior
# Aspect-ratio buckets (``--buckets``): where the bucket's crop starts in the resized image (SDXL's
# crop micro-conditioning; ``width``/``height`` are the original size).
CROP_TOP = "crop_top"
CROP_LEFT = "crop_left"
BUCKET = "bucket"  # between the transform and the sink only: the bucket's directory name
BUCKET_PREFIX = "bucket-"  # one MDS dataset per bucket below the output root: bucket-<W>x<H>
RECAPTION = "recaption"  # the converter's --recaption: the caption an image-to-text model wrote (the default name)

MAX_TOKENS = 77  # CLIP context length: the text length unless --text-length sets another


EXTRA_CAPTION_PREFIX = f"{CAPTION}_"  # the text column of every caption beyond the first: caption_NAME


def caption_columns(name: str) -> tuple[str, str, str]:
    """(text, embeddings, token ids) columns of caption ``name``: ``caption``, ``text_embeds`` and
    ``input_ids`` for the first caption (``name`` == ``caption``), ``caption_{name}``,
    ``text_embeds_{name}`` and ``input_ids_{name}`` for another one (``--captions``)."""
    if name == CAPTION:
        return CAPTION, TEXT_EMBEDS, INPUT_IDS
    return f"{EXTRA_CAPTION_PREFIX}{name}", f"{TEXT_EMBEDS}_{name}", f"{INPUT_IDS}_{name}"


def tokens_column(name: str = CAPTION) -> str:
    """The token-count column of caption ``name``: ``text_tokens``, or ``text_tokens_{name}``."""
    return TEXT_TOKENS if name == CAPTION else f"{TEXT_TOKENS}_{name}"


def check_caption_name(name: str, where: str = "--captions") -> str:
    """A caption name is a column name of letters, digits and underscores (it names MDS columns)."""
    if not name or not all(ch.isalnum() or ch == "_" for ch in name) or not name.isascii():
        raise ValueError(f"{where}: caption name {name!r} must be letters, digits and underscores")
    return name

# ---- text storage: which text columns a dataset holds ----------------------------------------------
TEXT_EMBEDS_ONLY, TEXT_IDS_ONLY, TEXT_BOTH = "embeds", "ids", "both"
TEXT_STORAGE = (TEXT_EMBEDS_ONLY, TEXT_IDS_ONLY, TEXT_BOTH)


def text_columns(text: str) -> tuple[str, ...]:
    """The text columns a dataset of text storage ``text`` holds."""
    if text not in TEXT_STORAGE:
        raise ValueError(f"text storage {text!r}: one of {', '.join(TEXT_STORAGE)}")
    return {TEXT_EMBEDS_ONLY: (TEXT_EMBEDS,), TEXT_IDS_ONLY: (INPUT_IDS,), TEXT_BOTH: (TEXT_EMBEDS, INPUT_IDS)}[text]
LATENT_CHANNELS = 4  # SD's VAE: the moments hold 2 * LATENT_CHANNELS channels: mean, then log-variance

# ---- files beside index.json ----------------------------------------------------------------------
DATASET_JSON = "dataset.json"
EMPTY_TEXT_EMBEDS = "empty_text_embeds.npy"

# ---- raw rows (sample data, download output, converter input) -----------------------------------
RAW_IMAGE = "jpg"  # encoded image bytes (any format PIL reads; the name follows img2dataset)
RAW_CAPTION = "caption"
RAW_KEY = "key"
RAW_URL = "url"
# Download output: img2dataset's names and values.
RAW_STATUS = "status"  # "success", "failed_to_download" or "failed_to_resize"
RAW_ERROR = "error_message"  # "reason: detail" of a failed row (the reason is what stats count), None on success
RAW_STATUS_SUCCESS = "success"  # values of RAW_STATUS
RAW_STATUS_FAILED_TO_DOWNLOAD = "failed_to_download"  # no image bytes came back
RAW_STATUS_FAILED_TO_RESIZE = "failed_to_resize"  # bytes came back but are no usable image
RAW_ORIGINAL_WIDTH = "original_width"  # size before an optional resize
RAW_ORIGINAL_HEIGHT = "original_height"
RAW_EXIF = "exif"  # JSON object of the original image's EXIF tags, None for a failed row
RAW_SHA256 = "sha256"  # hex SHA-256 of the bytes downloaded (before any resize), None for a failed row


def image_column(resolution: int) -> str:
    """Between the transform and encode stages: the uint8 HWC crop at one resolution."""
    return f"image_{int(resolution)}"


# ---- training batch keys (what loaders yield and the model consumes) -------------------------------
BATCH_MOMENTS = "vae_moments"  # (B, 2C, h, w) float: VAE posterior mean and log-variance, unscaled
BATCH_LATENTS = "vae_latents"  # (B, C, h, w) float: deterministic latents (AutoencoderDC), unscaled
BATCH_TEXT_EMBEDS = TEXT_EMBEDS  # (B, 77, D) float: conditioning (empty-caption embedding if dropped)
BATCH_INPUT_IDS = INPUT_IDS  # (B, 77) long
BATCH_POOLED_TEXT_EMBEDS = POOLED_TEXT_EMBEDS  # (B, P) float: the pooled vector (the empty caption's if dropped)
BATCH_TEXT_TOKENS = TEXT_TOKENS  # (B,) long: token counts, the attention mask (models with model.text_mask)
BATCH_SAMPLE_INDEX = "sample_index"  # (B,) long: the sample's index in its dataset (pins eval noise)
# Training batches also carry each sample's random draws (diffusion.loader.batches.NoiseDraws), float32:
BATCH_POSTERIOR_NOISE = "posterior_noise"  # (B, C, h, w) ε of the latent's draw from its moments (moments only)
BATCH_NOISE = "noise"  # (B, C, h, w) the diffusion noise ε
BATCH_OFFSET_NOISE = "offset_noise"  # (B, C) per-channel offset (used when model.offset_noise > 0)
BATCH_TIMESTEP_DRAW = "timestep_draw"  # (B,) uniform in [0, 1): the timestep is ⌊u·T⌋
BATCH_PERTURBATION_NOISE = "perturbation_noise"  # (B, C, h, w) only when model.input_perturbation > 0
BATCH_PATCH_KEEP = "patch_keep"  # (B, K) long, sorted: the latent patches a masked step keeps (model.masking)
BATCH_ROUTE_KEEP = "route_keep"  # (B, K) long, sorted: the patches a routed step sends through the span (model.routing)


def vae_moments_column(resolution: int) -> str:
    """Column name of the moments at one square resolution, e.g. ``vae_moments_256``."""
    return f"{_VAE_MOMENTS_PREFIX}{int(resolution)}"


def vae_latents_column(resolution: int) -> str:
    """Column name of deterministic latents (an autoencoder without a posterior), e.g. ``vae_latents_256``."""
    return f"{_VAE_LATENTS_PREFIX}{int(resolution)}"


def resolutions_in(columns) -> list[int]:
    """The resolutions whose moment (or latent) columns appear in ``columns`` (sorted)."""
    found = set()
    for c in columns:
        for prefix in (_VAE_MOMENTS_PREFIX, _VAE_LATENTS_PREFIX):
            if c.startswith(prefix):
                found.add(int(c[len(prefix):]))
    return sorted(found)


# ---- the latent space: which autoencoder made the stored columns, and how training scales them ----------
MOMENTS, LATENTS = "moments", "latents"  # what a dataset stores: posterior mean+log-variance, or latents
AUTOENCODERS = ("AutoencoderKL", "AutoencoderDC")  # the diffusers autoencoder classes the converter runs


@dataclasses.dataclass(frozen=True)
class LatentSpace:
    """The space a denoiser works in: the autoencoder (a diffusers class), its latent channels C and
    spatial downsampling f, and the affine map training applies once, ``latent = (z - shift) * scale``
    (decoding inverts it). ``stored`` says what the MDS columns hold: ``moments`` (an ``AutoencoderKL``'s
    posterior mean and log-variance, 2C channels in ``vae_moments_{R}``: training draws a fresh latent
    each time) or ``latents`` (an ``AutoencoderDC``'s deterministic latent, C channels in ``vae_latents_{R}``).
    The defaults are SD's VAE (4 channels, /8, no shift), what every dataset held before this was recorded."""

    autoencoder: str = "AutoencoderKL"
    channels: int = LATENT_CHANNELS
    downsample: int = 8
    scaling_factor: float = 0.18215
    shift_factor: float = 0.0
    stored: str = MOMENTS

    def __post_init__(self):
        if self.stored not in (MOMENTS, LATENTS):
            raise ValueError(f"latent storage {self.stored!r}: {MOMENTS} or {LATENTS}")

    @property
    def stored_channels(self) -> int:
        """Channels of a stored column: 2C for moments, C for latents."""
        return 2 * self.channels if self.stored == MOMENTS else self.channels

    def column(self, resolution: int) -> str:
        """The MDS column at ``resolution``: ``vae_moments_{R}`` or ``vae_latents_{R}``."""
        return vae_moments_column(resolution) if self.stored == MOMENTS else vae_latents_column(resolution)

    @property
    def batch_key(self) -> str:
        """The batch key the loader puts the stored column under."""
        return BATCH_MOMENTS if self.stored == MOMENTS else BATCH_LATENTS

    def describe(self) -> str:
        """One line for messages: ``AutoencoderKL, 16 channels, /8, moments, scale 0.3611, shift 0.1159``."""
        return (f"{self.autoencoder}, {self.channels} channels, /{self.downsample}, {self.stored}, "
                f"scale {self.scaling_factor:g}, shift {self.shift_factor:g}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "LatentSpace":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in fields})


def bucket_name(width: int, height: int) -> str:
    """The directory of one aspect-ratio bucket below a bucketed output root, e.g. ``bucket-320x192``."""
    return f"{BUCKET_PREFIX}{int(width)}x{int(height)}"


def bucket_size(name: str) -> tuple[int, int]:
    """(width, height) of a bucket's directory name (``bucket-320x192``)."""
    w, h = str(name)[len(BUCKET_PREFIX):].split("x")
    return int(w), int(h)


def mds_columns(resolutions, text_dim: int, downsample: int = 8, text: str = TEXT_EMBEDS_ONLY,
                bucket: tuple[int, int] | None = None, captions=(), text_length: int = MAX_TOKENS,
                tokens: bool = True, latent_space: LatentSpace | None = None,
                pooled_dim: int | None = None) -> dict[str, str]:
    """The MDS ``columns`` mapping for ``streaming.MDSWriter`` (``text``: the text storage). With
    ``bucket`` (width, height) the one resolution R names the pixel budget and ``vae_moments_{R}`` holds
    the bucket's ``8,H/f,W/f`` moments, beside the crop's top-left. ``captions``: the names of the
    captions beyond the first (``--captions``), each with its text and text columns. ``text_length``: the
    token length of ids and embeddings; ``tokens``: with the token counts (``text_tokens``).
    ``latent_space``: what the latent columns hold (None: SD's 4-channel moments; its downsampling is
    ``downsample``). ``pooled_dim``: the width P of a second text encoder's pooled vector, stored beside the
    embeddings (``pooled_text_embeds``; None: no second encoder)."""
    space = latent_space or LatentSpace(downsample=downsample)
    downsample = space.downsample
    columns = {}
    if bucket is not None and len(resolutions) != 1:
        raise ValueError(f"a bucket dataset holds one resolution (its pixel budget), got {list(resolutions)}")
    for r in resolutions:
        w, h = bucket if bucket is not None else (r, r)
        if r % downsample or w % downsample or h % downsample:
            raise ValueError(f"resolution {w}x{h} is not a multiple of the VAE downsampling factor {downsample}")
        columns[space.column(r)] = f"ndarray:float16:{space.stored_channels},{h // downsample},{w // downsample}"
    stored = text_columns(text)
    if TEXT_EMBEDS in stored:
        columns[TEXT_EMBEDS] = f"ndarray:float16:{int(text_length)},{int(text_dim)}"
    if INPUT_IDS in stored:
        columns[INPUT_IDS] = f"ndarray:int32:{int(text_length)}"
    if pooled_dim:
        columns[POOLED_TEXT_EMBEDS] = f"ndarray:float16:{int(pooled_dim)}"
    if tokens:
        columns[TEXT_TOKENS] = "int"
    columns[CAPTION] = "str"
    columns[KEY] = "str"
    columns[WIDTH] = "int"
    columns[HEIGHT] = "int"
    if bucket is not None:
        columns[CROP_TOP] = "int"
        columns[CROP_LEFT] = "int"
    for name in captions:
        caption, embeds, ids = caption_columns(check_caption_name(name))
        columns[caption] = "str"
        if TEXT_EMBEDS in stored:
            columns[embeds] = f"ndarray:float16:{int(text_length)},{int(text_dim)}"
        if INPUT_IDS in stored:
            columns[ids] = f"ndarray:int32:{int(text_length)}"
        if tokens:
            columns[tokens_column(name)] = "int"
    return columns


@dataclasses.dataclass
class DatasetInfo:
    """What ``dataset.json`` records about a converted dataset."""

    model: str  # model reference the VAE and text encoder came from (hub id or local dir)
    scaling_factor: float  # VAE latent scaling factor, applied once, by the model, at training time
    resolutions: list[int]
    text_dim: int  # D of text_embeds (the text encoder's hidden size)
    downsample: int = 8  # VAE spatial downsampling factor
    text: str = TEXT_BOTH  # text storage (TEXT_STORAGE); "both" for datasets written before it was recorded
    text_encoder: str | None = None  # reference of the tokenizer and text encoder (None: ``model``)
    empty_input_ids: list[int] | None = None  # token ids of "" (what caption dropout substitutes for ids)
    # The text encoder's fingerprint: ids and mean embeddings of fixed captions, checked when training
    # from ids (:func:`diffusion.models.text_encoder.text_probe`); None in datasets written before it.
    text_probe: dict | None = None
    count: int = 0  # samples written
    rows_in: int = 0  # rows read from the input
    rejects: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> count
    # Aspect-ratio buckets (``--buckets``), each {"name", "width", "height", "count"}: one MDS dataset per
    # bucket in the directory ``name`` below this one (with its own dataset.json); None: a square dataset.
    buckets: list[dict] | None = None
    # Several captions per image (``--captions``): their names, the first "caption" (None: one caption),
    # and how many samples have an empty one (name -> count; the first caption is never empty).
    captions: list[str] | None = None
    empty_captions: dict[str, int] = dataclasses.field(default_factory=dict)
    # Text length and encoder (``--text-length``, the text encoder's config ``model_type``: None in datasets
    # written before they were recorded, CLIP's 77), and the token count of "" (None: the dataset has no
    # ``text_tokens`` columns, written before they were stored).
    text_length: int = MAX_TOKENS
    text_encoder_type: str | None = None
    empty_text_tokens: int | None = None
    # The latent space (:class:`LatentSpace`): the autoencoder class, its latent channels, the shift
    # training subtracts before scaling, and whether the columns hold posterior moments or latents. A
    # dataset.json without them was written by SD's 4-channel AutoencoderKL, as moments.
    autoencoder: str = "AutoencoderKL"
    latent_channels: int = LATENT_CHANNELS
    shift_factor: float = 0.0
    latents: str = MOMENTS
    # A second text encoder's pooled vector (Flux's layout: CLIP beside T5): its width P and the empty
    # caption's vector (what caption dropout substitutes); None: the dataset has no pooled_text_embeds column.
    pooled_text_dim: int | None = None
    empty_pooled_text_embeds: list[float] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def latent_space(self) -> LatentSpace:
        """The latent space this dataset's columns are in."""
        return LatentSpace(autoencoder=self.autoencoder, channels=int(self.latent_channels),
                           downsample=int(self.downsample), scaling_factor=float(self.scaling_factor),
                           shift_factor=float(self.shift_factor), stored=self.latents)

    def set_latent_space(self, space: LatentSpace) -> None:
        """Record ``space`` in this dataset's fields."""
        self.autoencoder, self.latent_channels, self.downsample = space.autoencoder, space.channels, space.downsample
        self.scaling_factor, self.shift_factor, self.latents = space.scaling_factor, space.shift_factor, space.stored

    @property
    def has_tokens(self) -> bool:
        """Whether the dataset stores token counts (``text_tokens``): attention masks can be made."""
        return self.empty_text_tokens is not None

    def empty_pooled(self):
        """The empty caption's pooled vector (float16 (P,)), or None where the dataset stores none."""
        if self.empty_pooled_text_embeds is None:
            return None
        import numpy as np
        return np.asarray(self.empty_pooled_text_embeds, dtype=np.float16)

    @property
    def text_encoder_ref(self) -> str:
        """Where the token ids' tokenizer and the embeddings' text encoder come from."""
        return self.text_encoder or self.model

    def save(self, directory: str) -> str:
        path = os.path.join(directory, DATASET_JSON)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=2, sort_keys=True)
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, d: dict) -> "DatasetInfo":
        known = {f.name for f in dataclasses.fields(cls)}
        info = cls(**{k: v for k, v in d.items() if k in known})
        if info.text not in TEXT_STORAGE:
            raise ValueError(f"text={info.text!r} is none of {', '.join(TEXT_STORAGE)}")
        if info.latents not in (MOMENTS, LATENTS):
            raise ValueError(f"latents={info.latents!r} is none of {MOMENTS}, {LATENTS}")
        return info

    @classmethod
    def load(cls, directory: str) -> "DatasetInfo":
        """Read ``dataset.json`` from a local directory."""
        path = os.path.join(directory, DATASET_JSON)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path} not found: is {directory!r} a dataset written by convert/laion_to_mds.py?")
        with open(path) as f:
            return cls.from_dict(json.load(f))
