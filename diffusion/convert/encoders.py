"""The encode stage: uint8 crops and token ids in; VAE posterior moments and text embeddings out (or,
with text storage ``ids``, the token ids passed through and no text encoder run here: training runs it).

:class:`LatentTextEncoder` is a Ray Data ``map_batches`` callable (a class, so the models load once per
actor). It runs on CUDA in bf16 (fp16 where bf16 is unsupported) when a GPU is visible, else on CPU in
fp32. Images arrive as uint8 and are scaled to [-1, 1] here, right next to the VAE, so no float copy of
an image ever crosses a stage boundary.

torch is imported where a model runs, not with the module: Ray Data's coordinating actors (Ray Train's
DatasetManager, the stream's SplitCoordinator) unpickle a pipeline naming :class:`LatentTextEncoder` and
so import this module, and would otherwise each load torch for nothing.
"""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from diffusion import schema
from diffusion.convert.curate import CURATED_COLUMNS  # --embed's columns, carried through as they came
from diffusion.models import loading
from diffusion.models.text_encoder import attention_mask, pick_device_and_dtype, text_probe, tokenize

if TYPE_CHECKING:
    import torch

STAGE_SECONDS = "_encode_seconds"  # per-row share of the batch's wall time, when timing is on


def _inference_mode(method):
    """``torch.inference_mode()`` around each call of ``method``, torch imported at the call."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        import torch
        with torch.inference_mode():
            return method(*args, **kwargs)
    return run


def normalize_images(images: np.ndarray, device, dtype) -> torch.Tensor:
    """uint8 (B, H, W, 3) -> float (B, 3, H, W) in [-1, 1], converted on the device."""
    import torch
    x = torch.from_numpy(np.ascontiguousarray(images)).to(device, non_blocking=True)
    return x.permute(0, 3, 1, 2).to(dtype).div(127.5).sub(1.0)


class TextEncoder:
    """Tokenizer + text encoder; the last hidden state is the conditioning (SD2). A T5 reads each
    caption's attention mask (its token count), CLIP the padded ids whole
    (:func:`diffusion.models.loading.text_encoder_takes_mask`); in Flux's layout the sequence encoder is T5
    (``text_encoder_2/``), read whole as FluxPipeline reads it (:func:`~diffusion.models.loading.sequence_reads_mask`)."""

    def __init__(self, model: str, device=None, dtype=None, text_length: int = schema.MAX_TOKENS):
        self.device, default_dtype = pick_device_and_dtype(device)
        self.dtype = dtype or default_dtype
        self.tokenizer = loading.load_tokenizer(model)
        self.model = loading.load_text_encoder(model, dtype=self.dtype).to(self.device)
        self.dim = int(self.model.config.hidden_size)
        self.kind = self.model.config.model_type
        self.takes_mask = loading.sequence_reads_mask(model, self.kind)
        self.text_length = int(text_length)

    @_inference_mode
    def encode_ids(self, input_ids: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
        if len(input_ids) == 0:
            return np.zeros((0, self.text_length, self.dim), np.float16)
        import torch
        ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long, device=self.device)
        mask = None
        if self.takes_mask:
            if counts is None:
                raise ValueError(f"the {self.kind} text encoder reads an attention mask: give the captions' token counts")
            mask = attention_mask(torch.as_tensor(np.asarray(counts), device=self.device), ids.shape[1]).long()
        return self.model(ids, attention_mask=mask).last_hidden_state.to(torch.float16).cpu().numpy()

    def encode_captions(self, captions: list[str]) -> np.ndarray:
        return self.encode_ids(*tokenize(self.tokenizer, captions, self.text_length))


class PooledTextEncoder:
    """A model reference's second text encoder in Flux's layout: CLIP's pooled vector (``pooler_output``) of each
    caption, padded to its tokenizer's length, as FluxPipeline computes ``pooled_prompt_embeds``."""

    def __init__(self, model: str, device=None, dtype=None):
        self.device, default_dtype = pick_device_and_dtype(device)
        self.dtype = dtype or default_dtype
        encoder, self.tokenizer = loading.load_pooled_text_encoder(model, dtype=self.dtype)
        self.model = encoder.to(self.device)
        self.dim = int(self.model.config.hidden_size)
        stated = self.tokenizer.model_max_length
        self.length = int(stated) if stated and stated < 10 ** 6 else schema.MAX_TOKENS  # FluxPipeline's 77 where none

    @_inference_mode
    def encode_captions(self, captions) -> np.ndarray:
        """(B, P) float16: the captions' pooled vectors."""
        captions = [str(c) for c in captions]
        if not captions:
            return np.zeros((0, self.dim), np.float16)
        import torch
        ids, _ = tokenize(self.tokenizer, captions, self.length)
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        return self.model(ids).pooler_output.to(torch.float16).cpu().numpy()


class VaeEncoder:
    """What the autoencoder's encoder stores (:attr:`space`): an ``AutoencoderKL``'s posterior moments, mean
    and log-variance concatenated on the channel axis, or an ``AutoencoderDC``'s deterministic latents."""

    def __init__(self, model: str, device=None, dtype=None):
        self.device, default_dtype = pick_device_and_dtype(device)
        self.dtype = dtype or default_dtype
        self.model = loading.load_vae(model, dtype=self.dtype).to(self.device)
        self.space = loading.latent_space_of(dict(self.model.config))
        self.downsample = self.space.downsample
        self.scaling_factor = self.space.scaling_factor

    @_inference_mode
    def moments(self, images: np.ndarray) -> np.ndarray:
        """(B, 2C or C, H/f, W/f) float16: the stored column of uint8 (B, H, W, 3) crops."""
        import torch
        if len(images) == 0:
            h, w = np.asarray(images).shape[1:3]
            return np.zeros((0, self.space.stored_channels, h // self.downsample, w // self.downsample), np.float16)
        encoded = self.model.encode(normalize_images(images, self.device, self.dtype))
        if self.space.stored == schema.LATENTS:
            return encoded.latent.to(torch.float16).cpu().numpy()
        posterior = encoded.latent_dist
        return torch.cat([posterior.mean, posterior.logvar], dim=1).to(torch.float16).cpu().numpy()

    @_inference_mode
    def decode_mean(self, moments: np.ndarray) -> np.ndarray:
        """uint8 (B, H, W, 3) images decoded from the posterior means, or the latents (for previews)."""
        import torch
        mean = torch.as_tensor(np.asarray(moments)[:, : self.space.channels], device=self.device)
        x = self.model.decode(mean.to(self.dtype)).sample.float().clamp(-1, 1)
        return ((x + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


class LatentTextEncoder:
    """Ray ``map_batches`` callable: the transform's output in, the MDS columns out."""

    def __init__(self, model: str, resolutions, device=None, cpu_threads: int | None = None,
                 record_timing: bool = False, text: str = schema.TEXT_EMBEDS_ONLY, captions=(),
                 text_length: int = schema.MAX_TOKENS):
        if cpu_threads:  # an actor holding a fraction of a CPU must not spawn one thread per core
            import torch
            torch.set_num_threads(max(1, int(cpu_threads)))
        self.vae = VaeEncoder(model, device)
        self.text_columns = schema.text_columns(text)
        self.text = (TextEncoder(model, device, text_length=text_length) if schema.TEXT_EMBEDS in self.text_columns
                     else None)
        # Flux's layout: CLIP's pooled vector beside T5's sequence (pooled_text_embeds)
        self.pooled = (PooledTextEncoder(model, device) if self.text is not None and loading.pooled_text_slots(model)
                       else None)
        self.resolutions = sorted({int(r) for r in resolutions})
        self.record_timing = record_timing
        self.captions = tuple(captions)  # further captions (--captions): encoded or passed on as the first

    def bucket_moments(self, buckets, images) -> np.ndarray:
        """Moments of crops that travel as uint8 HWC bytes, each of its bucket's shape; out as bytes
        too (float16, C x H/f x W/f), in the batch's order."""
        out = np.empty(len(buckets), dtype=object)
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(buckets):
            groups.setdefault(str(name), []).append(i)
        for name, rows in groups.items():
            w, h = schema.bucket_size(name)
            stacked = np.stack([np.frombuffer(images[i], np.uint8).reshape(h, w, 3) for i in rows])
            for i, m in zip(rows, self.vae.moments(stacked)):
                out[i] = m.tobytes()
        return out

    def __call__(self, batch: dict) -> dict:
        start = time.perf_counter()
        # the token counts travel through when the transform made them (it always does; hand-made batches may not)
        out = {c: batch[c] for c in (schema.KEY, schema.CAPTION, schema.WIDTH, schema.HEIGHT, schema.TEXT_TOKENS)
               if c in batch}
        ids = np.asarray(batch[schema.INPUT_IDS], dtype=np.int32)
        n = len(out[schema.KEY])
        if schema.BUCKET in batch:  # aspect-ratio buckets: one VAE call per bucket in the batch
            for c in (schema.BUCKET, schema.CROP_TOP, schema.CROP_LEFT):
                out[c] = batch[c]
            r = self.resolutions[0]
            out[self.vae.space.column(r)] = self.bucket_moments(batch[schema.BUCKET], batch[schema.image_column(r)])
        else:
            for r in self.resolutions:
                out[self.vae.space.column(r)] = self.vae.moments(batch[schema.image_column(r)])
        if schema.INPUT_IDS in self.text_columns:
            out[schema.INPUT_IDS] = ids
        if self.text is not None:
            out[schema.TEXT_EMBEDS] = self.text.encode_ids(ids, batch.get(schema.TEXT_TOKENS))
        if self.pooled is not None:
            out[schema.POOLED_TEXT_EMBEDS] = self.pooled.encode_captions(batch[schema.CAPTION])
        for name in self.captions:
            text, embeds, extra_ids = schema.caption_columns(name)
            tokens = schema.tokens_column(name)
            out[text] = batch[text]
            if tokens in batch:
                out[tokens] = batch[tokens]
            if schema.INPUT_IDS in self.text_columns:
                out[extra_ids] = np.asarray(batch[extra_ids], dtype=np.int32)
            if self.text is not None:
                out[embeds] = self.text.encode_ids(np.asarray(batch[extra_ids], dtype=np.int32), batch.get(tokens))
        for name, value in batch.items():  # carry the earlier stages' timings (and --embed's scores) to the sink
            if (name.startswith("_") and name.endswith("_seconds")) or name in CURATED_COLUMNS:
                out[name] = value
        if self.record_timing:
            out[STAGE_SECONDS] = np.full(n, (time.perf_counter() - start) / max(n, 1))
        return out


def describe_dataset(model_ref: str, resolutions, text: str = schema.TEXT_EMBEDS_ONLY,
                     text_length: int = schema.MAX_TOKENS, tokens: bool = True) -> tuple[schema.DatasetInfo, np.ndarray]:
    """What training needs to know of samples encoded with ``model_ref`` (``dataset.json`` without the
    counts) and the text embedding of "" (``empty_text_embeds.npy``, written whatever the text storage:
    training from ids checks its text encoder reproduces it), from the same tokenizer and text encoder
    the encoder actors run: one description for the converter's output and the online stream. ``tokens``:
    the samples store token counts (``text_tokens``)."""
    space = loading.latent_space_of(loading.load_vae_config(model_ref))
    encoder = TextEncoder(model_ref, device="cpu", text_length=text_length)
    pooled = PooledTextEncoder(model_ref, device="cpu") if loading.pooled_text_slots(model_ref) else None
    empty_ids, empty_counts = tokenize(encoder.tokenizer, [""], text_length)
    if os.path.isdir(os.path.expanduser(model_ref)):  # as convert.json: training reads it from any directory
        model_ref = os.path.abspath(os.path.expanduser(model_ref))
    info = schema.DatasetInfo(model=model_ref, scaling_factor=space.scaling_factor,
                              resolutions=list(resolutions), text_dim=encoder.dim,
                              downsample=space.downsample, text=text, text_encoder=model_ref,
                              empty_input_ids=[int(i) for i in empty_ids[0]],
                              text_probe=text_probe(encoder.tokenizer, encoder.encode_ids, text_length),
                              text_length=int(text_length), text_encoder_type=encoder.kind,
                              empty_text_tokens=int(empty_counts[0]) if tokens else None)
    info.set_latent_space(space)
    if pooled is not None and text != schema.TEXT_IDS_ONLY:
        info.pooled_text_dim = pooled.dim
        info.empty_pooled_text_embeds = [float(v) for v in pooled.encode_captions([""])[0]]
    return info, encoder.encode_ids(empty_ids, empty_counts)[0]
