"""The frozen text encoder on the training device: conditioning from stored token ids.

A dataset converted with ``--text ids`` holds the 77 token ids of each caption instead of the text
encoder's 77×D output (308 bytes instead of ≈158 KB at SD2 size). Training then runs the text encoder
itself, each step, on the batch's ids: frozen (no gradients, eval mode), in bf16 on a GPU (fp32 on the
CPU, as the converter runs it there), its output rounded to float16 as stored embeddings are, so a
step sees what it would have read from a dataset of embeddings of the same rows.

:class:`FrozenTextEncoder` is deliberately not an ``nn.Module`` child of the ComposerModel: it is not
trained, so it stays out of the optimizer, the EMA, the checkpoints (it is loaded again from its
reference) and FSDP's wrapping, and each rank holds a whole copy (OpenCLIP-H's text encoder is ≈0.7 GB
in bf16). It times itself, so a run can show the text encoder's share of step time
(:class:`diffusion.train.callbacks.text_encoder_share.TextEncoderShare`).

torch is imported where a function needs it, not with the module: the converter's encoder module imports
this one, and Ray Data's coordinating actors that unpickle a pipeline naming the encoder would otherwise each
load torch for nothing.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING

import numpy as np

from diffusion import schema
from diffusion.errors import DatasetMismatchError, ModelReferenceError
from diffusion.models import loading
from diffusion.models.tokens import tokenize  # noqa: F401 (torch-free, for the converter's transform actors)

if TYPE_CHECKING:
    import torch

# Largest difference allowed between the dataset's empty-caption embedding and this encoder's, relative
# to the embedding's largest magnitude: float16 rounding and another summation order stay far below it,
# another text encoder far above.
EMPTY_EMBEDDING_TOLERANCE = 0.05


# text_probe's field holding the sha256 of the encoder's weights (:func:`weights_fingerprint`); absent in
# datasets converted before it was recorded, whose encoder is checked by the probe captions only.
WEIGHTS_SHA256 = "weights_sha256"

# Captions whose embeddings fingerprint a text encoder (``dataset.json``'s ``text_probe``): the empty
# caption alone tells a causal encoder's first tokens and padding, not how it reads words.
PROBE_CAPTIONS = ("a red bicycle leaning against a brick wall at noon",
                  "an oil painting of two grey cats asleep on a blue sofa, evening light")


def attention_mask(counts: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) bool, True on each caption's tokens: from the token counts :func:`tokenize` gives."""
    import torch
    return torch.arange(int(length), device=counts.device)[None, :] < counts.to(torch.long)[:, None]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of a text encoder's weights, whatever precision they were loaded in: each parameter as
    float32 (its shape and values), in the order the model registers them, a tensor equal to an earlier
    one (a tied embedding) once. Names are left out, so a transformers release that renames a module
    still gives the same fingerprint; any changed value gives another."""
    import torch
    total, seen = hashlib.sha256(), set()
    for parameter in model.parameters():
        values = parameter.detach().to("cpu", torch.float32).contiguous().numpy()
        one = hashlib.sha256(repr(values.shape).encode())
        one.update(values.data)
        digest = one.digest()
        if digest not in seen:
            seen.add(digest)
            total.update(digest)
    return total.hexdigest()


def text_probe(tokenizer, encode_ids, length: int = schema.MAX_TOKENS, model: torch.nn.Module | None = None) -> dict:
    """The fingerprint of a text encoder the converter records for training from ids: the ids of
    :data:`PROBE_CAPTIONS` and the mean over tokens of their embeddings (``encode_ids(ids, counts)`` →
    (B, length, D)), rounded to 5 significant digits, and the sha256 of the weights of ``model`` (by
    default the ``model`` of the object whose method ``encode_ids`` is, as a converter's ``TextEncoder``),
    :func:`weights_fingerprint`: the probe captions alone miss an encoder that differs only on words
    they do not hold."""
    import torch
    ids, counts = tokenize(tokenizer, PROBE_CAPTIONS, length)
    means = np.asarray(encode_ids(ids, counts), dtype=np.float32).mean(axis=1)
    probe = {"captions": list(PROBE_CAPTIONS), "input_ids": ids.tolist(), "text_tokens": counts.tolist(),
             "mean_embedding": [[float(f"{v:.5g}") for v in row] for row in means]}
    model = model if model is not None else getattr(getattr(encode_ids, "__self__", None), "model", None)
    if isinstance(model, torch.nn.Module):
        probe[WEIGHTS_SHA256] = weights_fingerprint(model)
    return probe


def _probe_difference(encoder: "FrozenTextEncoder", probe: dict) -> float:
    """Largest difference between the probe's recorded mean embeddings and ``encoder``'s, relative to the
    recorded ones' largest magnitude (inf where the shapes differ)."""
    import torch
    ids = torch.as_tensor(np.asarray(probe["input_ids"], dtype=np.int64))
    counts = probe.get("text_tokens")  # absent in probes recorded before token counts: CLIP's, maskless
    counts = torch.as_tensor(counts) if counts is not None else None
    mine = encoder(ids, counts).float().mean(dim=1).numpy()
    theirs = np.asarray(probe["mean_embedding"], dtype=np.float32)
    if mine.shape != theirs.shape:
        return float("inf")
    return float(np.abs(mine - theirs).max()) / (float(np.abs(theirs).max()) or 1.0)


def empty_caption_ids(tokenizer, length: int = schema.MAX_TOKENS) -> np.ndarray:
    """The token ids of "" (int32, ``length``): what caption dropout substitutes in a batch of ids."""
    return tokenize(tokenizer, [""], length)[0][0]


class _Eager:
    """``torch.compiler.disable`` on a method, applied at the method's first lookup (torch is loaded by then:
    the instance holds a torch model); the disabled method then replaces this wrapper in the class."""

    def __init__(self, method):
        self.method = method

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, instance, owner):
        import torch
        disabled = torch.compiler.disable(self.method)
        setattr(owner, self.name, disabled)
        return disabled if instance is None else disabled.__get__(instance, owner)


class FrozenTextEncoder:
    """``encoder(input_ids, counts)`` → float16 (B, L, D) text embeddings, on the device of the ids (a T5
    reads the token ``counts`` as its attention mask; CLIP reads the padded ids whole, as SD2 does).

    The weights move to the ids' device (bf16 on CUDA, fp16 where bf16 is unsupported) the first time
    they are needed there; the time each call takes is summed (CUDA events on a GPU, read only by
    :meth:`take_seconds`, so timing adds no host sync to a step).
    """

    def __init__(self, model: torch.nn.Module, ref: str):
        self.model = model.eval().requires_grad_(False)
        self.ref = ref
        self.dim = int(model.config.hidden_size)
        # as the converter reads it: T5 with its mask, except in Flux's layout (loading.sequence_reads_mask)
        self.takes_mask = loading.sequence_reads_mask(ref, model.config.model_type)
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _on(self, device: torch.device) -> None:
        current = next(self.model.parameters()).device
        if current == device:
            return
        self.model.to(device=device, dtype=encoding_dtype(device.type))

    @_Eager  # eager, timed; under trainer.compile the UNet's graph takes the embeddings as input
    def __call__(self, input_ids: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        import torch
        self._on(input_ids.device)
        mask = None
        if self.takes_mask:
            if counts is None:
                raise ValueError(f"text encoder {self.ref!r} reads an attention mask: the batch must carry "
                                 f"{schema.BATCH_TEXT_TOKENS} (the captions' token counts)")
            mask = attention_mask(counts.to(input_ids.device), input_ids.shape[1]).long()
        cuda = input_ids.device.type == "cuda"
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        else:
            start = time.perf_counter()
        with torch.no_grad():  # not inference_mode: the UNet's backward saves these embeddings
            embeds = self.model(input_ids.long(), attention_mask=mask).last_hidden_state.to(torch.float16)
        if cuda:
            end.record()
            self._events.append((begin, end))
        else:
            self._seconds += time.perf_counter() - start
        return embeds

    def take_seconds(self) -> float:
        """Seconds spent encoding since the last call (waits for the GPU's last encode to finish)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(b.elapsed_time(e) for b, e in self._events) / 1000.0
            self._events.clear()
        seconds, self._seconds = self._seconds, 0.0
        return seconds


def encoding_dtype(device_type: str) -> torch.dtype:
    """The dtype a frozen encoder encodes in on ``device_type``: bf16 on CUDA (fp16 where bf16 is unsupported),
    float32 elsewhere."""
    import torch
    if device_type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def pick_device_and_dtype(device: str | None = None) -> tuple[torch.device, torch.dtype]:
    """Where a frozen model encodes (``device``, else CUDA when visible, else CPU) and its :func:`encoding_dtype`:
    the converter's encoders, captioner and curation tower."""
    import torch
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, encoding_dtype(device.type)


def load_frozen_text_encoder(ref: str, *, text_dim: int, empty_input_ids, empty_text_embeds=None,
                             probe: dict | None = None, where: str = "", empty_tokens: int | None = None,
                             dataset: str = "", dtype: torch.dtype | None = None,
                             check_embeddings: bool = True) -> FrozenTextEncoder:
    """The text encoder of ``ref`` for training from ids, checked before the first step: it loads, its
    width is the UNet's ``text_dim``, the ids fit its vocabulary, and where the dataset's empty-caption
    embedding is given, it reproduces it from ``empty_input_ids``, and where the dataset recorded a
    ``probe`` (:func:`text_probe`), the probe captions' embeddings too (so the ids were made for it), and
    where the probe records its weights' sha256, the same weights (any other encoder, even one differing
    only on words neither probe caption holds, is refused). ``where`` says where the reference came from,
    ``dataset`` which dataset recorded the probe, for the error messages.

    ``dtype``: the dtype the encoder will train in; the returned encoder holds it. ``check_embeddings``
    false (every local rank but 0, which checks the same files): loaded straight in ``dtype``, only width and
    vocabulary checked, so a node holds one float32 copy (a T5-XXL is ~19 GB in float32), not one per rank;
    true: loaded in float32 for the embedding and weight checks, then cast to ``dtype``."""
    import torch
    where = f" ({where})" if where else ""
    dataset = f"dataset {dataset}" if dataset else "the dataset"
    try:
        model = loading.load_text_encoder(ref, None if check_embeddings else dtype)
    except ModelReferenceError as e:
        raise ModelReferenceError(f"training from token ids needs the text encoder {ref!r}{where}, which cannot "
                                  f"be loaded: {e}") from None
    except (OSError, ValueError) as e:
        raise ModelReferenceError(f"training from token ids needs the text encoder {ref!r}{where}, which cannot "
                                  f"be loaded ({type(e).__name__}: {' '.join(str(e).split())})") from None
    encoder = FrozenTextEncoder(model, ref)
    if encoder.dim != int(text_dim):
        raise DatasetMismatchError(f"text encoder {ref!r}{where} has width {encoder.dim} but the UNet's "
                                   f"cross_attention_dim is {text_dim}: name the text encoder the UNet is made for")
    ids = np.asarray(empty_input_ids, dtype=np.int64)
    vocab = int(model.config.vocab_size)
    if ids.ndim != 1 or ids.min() < 0 or ids.max() >= vocab:
        raise DatasetMismatchError(f"the dataset's token ids do not fit text encoder {ref!r}{where} (ids up to "
                                   f"{int(ids.max())}, vocabulary {vocab}): name the text encoder it was converted for")
    if not check_embeddings:
        return encoder
    if empty_text_embeds is not None:
        counts = torch.tensor([int(empty_tokens)]) if empty_tokens is not None else None
        mine = encoder(torch.from_numpy(ids)[None], counts)[0].float().numpy()
        theirs = np.asarray(empty_text_embeds, dtype=np.float32)
        scale = float(np.abs(theirs).max()) or 1.0
        difference = float(np.abs(mine - theirs).max()) / scale if mine.shape == theirs.shape else float("inf")
        if difference > EMPTY_EMBEDDING_TOLERANCE:
            raise DatasetMismatchError(
                f"text encoder {ref!r}{where} does not give the dataset's {schema.EMPTY_TEXT_EMBEDS} for the empty "
                f"caption (largest difference {difference:.3g} of its scale; float rounding stays under "
                f"{EMPTY_EMBEDDING_TOLERANCE}): the dataset's ids were made for another text encoder; name that one "
                f"in model.text_encoder")
    if probe:
        difference = _probe_difference(encoder, probe)
        if difference > EMPTY_EMBEDDING_TOLERANCE:
            raise DatasetMismatchError(
                f"text encoder {ref!r}{where} does not give the embeddings dataset.json's text_probe recorded for "
                f"its captions (largest difference {difference:.3g} of their scale; float rounding stays under "
                f"{EMPTY_EMBEDDING_TOLERANCE}): the dataset's ids were encoded by another text encoder when it was "
                f"converted; name that one in model.text_encoder")
    if probe and probe.get(WEIGHTS_SHA256):
        mine = weights_fingerprint(encoder.model)
        if mine != probe[WEIGHTS_SHA256]:
            raise DatasetMismatchError(
                f"text encoder {ref!r}{where} is not the one {dataset} was converted with: its weights' sha256 "
                f"{mine[:16]} differs from the {probe[WEIGHTS_SHA256][:16]} that dataset.json's text_probe records "
                f"(a copy in another precision, or with any row changed, is another encoder): name the text encoder "
                f"the dataset was converted with in model.text_encoder, or convert the dataset again with this one")
    encoder.take_seconds()  # the checks are not training time
    if dtype is not None:
        model.to(dtype)  # the float32 copy goes once checked
    return encoder
