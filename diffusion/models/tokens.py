"""Captions to token ids, without torch: the converter's transform actors tokenize and nothing more.

:func:`tokenize` is the one way captions become token ids, everywhere (converter, training, sampling).
:func:`load_tokenizer_without_torch` loads a model's tokenizer in a process of its own that needs no torch:
in a Ray actor of the conversion's transform stage, transformers is imported with its ``USE_TORCH`` switch
off. A tokenizer needs no torch, and such an actor then holds about 100 MB instead of about 490 MB and starts
about 3 CPU-s sooner (a node with 90 transform actors: about 35 GB less). A process that may load a model
later (the driver, a test, an online trainer) keeps transformers as it is.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from diffusion import schema
from diffusion.models import loading


def tokenize(tokenizer, captions, length: int = schema.MAX_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """The one way captions become token ids, everywhere (converter, training, sampling): padded to
    ``length`` and truncated. Returns (ids int32 (B, length), token counts int32 (B,)): the count is the
    caption's tokens before the padding, special tokens included, so ``arange(length) < count`` is its
    attention mask (:func:`diffusion.models.text_encoder.attention_mask`)."""
    captions = list(captions)
    if not captions:
        return np.zeros((0, int(length)), np.int32), np.zeros((0,), np.int32)
    out = tokenizer(captions, padding="max_length", max_length=int(length), truncation=True, return_tensors="np")
    return out["input_ids"].astype(np.int32), out["attention_mask"].sum(axis=1).astype(np.int32)


def _in_ray_actor() -> bool:
    """True in a Ray actor's own process (not the driver, where ``get_actor_id()`` is None)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 (an older or newer Ray without it: keep transformers as it is)
        return False


def load_tokenizer_without_torch(ref: str):
    """``ref``'s tokenizer (:func:`diffusion.models.loading.load_tokenizer`); in a Ray actor that has not
    imported transformers yet, transformers comes in without torch (see the module docstring)."""
    if "transformers" in sys.modules or not _in_ray_actor():
        return loading.load_tokenizer(ref)
    saved = {name: os.environ.get(name) for name in ("USE_TORCH", "TRANSFORMERS_NO_ADVISORY_WARNINGS")}
    # transformers reads USE_TORCH once, at its import; the advisory warning would say no framework was found
    os.environ.update(USE_TORCH="0", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    try:
        return loading.load_tokenizer(ref)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
