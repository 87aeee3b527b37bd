"""The captioning stage (``--recaption``): an image-to-text model writes a new caption for every image.

    read -> ImageCaptionTransform -> Recaptioner -> LatentTextEncoder -> MDSPartSink

:class:`Recaptioner` is a Ray Data ``map_batches`` callable (a class, so the model loads once per
actor). It reads the transform's uint8 crops (the largest resolution, or each row's bucket crop),
generates greedily and adds the decoded text as one more caption (``--captions``' columns: its text in
``caption_NAME`` and its token ids and count from the dataset's own tokenizer in ``input_ids_NAME`` and
``text_tokens_NAME``), which the
encode stage encodes as it encodes the others; the original caption and its encoding are untouched. The model is any
transformers image-to-text model :func:`diffusion.models.loading.load_captioner` loads (BLIP,
Florence-2, LLaVA, ...; ``--recaption-prompt`` for those that need an instruction). It runs on CUDA
in bf16 (fp16 where bf16 is unsupported) when a GPU is visible, else on CPU in fp32.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch

from diffusion import schema
from diffusion.convert.settings import MAX_NEW_TOKENS
from diffusion.errors import ModelReferenceError
from diffusion.models import loading
from diffusion.models.text_encoder import pick_device_and_dtype, tokenize

STAGE_SECONDS = "_recaption_seconds"  # per-row share of the batch's wall time, when timing is on


PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")  # loading them unpickles: code can run


def check_captioner(path: str, ref: str) -> None:
    """Refuse, in one line before any actor starts, a captioning model directory (``path``, found for
    ``--recaption ref``) that loading would refuse or that could run code: weights that are not
    safetensors (pickled ``.bin``, ``.pt``: unpickling runs code), a config asking for the model's own
    code (``auto_map``: remote code, which is never trusted), or safetensors or a processor that do not
    load."""
    names = sorted(os.listdir(path))
    where = f"--recaption {ref}" + (f" ({path})" if os.path.abspath(os.path.expanduser(ref)) != path else "")
    for name in (n for n in names if n.endswith(".json")):
        try:
            with open(os.path.join(path, name)) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ModelReferenceError(f"{where}: {name} is not JSON ({type(e).__name__}: {' '.join(str(e).split())})"
                                      ) from None
        if isinstance(config, dict) and "auto_map" in config:
            raise ModelReferenceError(f"{where}: {name} asks for the model's own code (auto_map), which the converter "
                                      f"never runs: use a model transformers implements (BLIP, Florence-2, LLaVA, ...)")
    safe = [n for n in names if n.endswith(".safetensors")]
    if not safe:
        pickled = [n for n in names if n.endswith(PICKLED_WEIGHTS)]
        what = (f"holds its weights only as pickled files ({', '.join(pickled)}), which can run code when loaded: "
                f"give a copy with .safetensors weights" if pickled else "holds no .safetensors weights")
        raise ModelReferenceError(f"{where} {what}")
    from safetensors import safe_open
    from transformers import AutoProcessor
    for name in safe:
        try:
            with safe_open(os.path.join(path, name), framework="pt") as f:
                f.keys()
        except Exception as e:  # the header is read only: a damaged or foreign file
            raise ModelReferenceError(f"{where}: {name} is not a safetensors file ({type(e).__name__}: "
                                      f"{' '.join(str(e).split())})") from None
    try:
        AutoProcessor.from_pretrained(path)
    except Exception as e:  # whatever a broken processor's files raise: the actors would raise it too
        raise ModelReferenceError(f"{where}: its processor does not load ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:300]})") from None


def crops_of(batch: dict, resolution: int) -> list[np.ndarray]:
    """The batch's uint8 HWC crops at ``resolution``; with buckets, each row's crop in its bucket's shape."""
    images = batch[schema.image_column(resolution)]
    if schema.BUCKET not in batch:
        return list(images)
    crops = []
    for name, data in zip(batch[schema.BUCKET], images):
        w, h = schema.bucket_size(name)
        crops.append(np.frombuffer(data, np.uint8).reshape(h, w, 3))
    return crops


class Recaptioner:
    """Ray ``map_batches`` callable: the transform's output in, the same columns and ``column`` out."""

    def __init__(self, model: str, resolution: int, column: str = schema.RECAPTION, tokenizer: str | None = None,
                 max_new_tokens: int = MAX_NEW_TOKENS, prompt: str | None = None, device=None,
                 cpu_threads: int | None = None, record_timing: bool = False, text_length: int = schema.MAX_TOKENS):
        if cpu_threads:  # an actor holding a fraction of a CPU must not spawn one thread per core
            torch.set_num_threads(max(1, int(cpu_threads)))
        self.device, self.dtype = pick_device_and_dtype(device)
        self.processor, self.model = loading.load_captioner(model, dtype=self.dtype)
        self.model.to(self.device)
        self.resolution, self.column = int(resolution), column
        self.max_new_tokens, self.prompt = int(max_new_tokens), prompt
        self.record_timing = record_timing
        # the dataset's tokenizer (the text encoder's), for the new caption's token ids; None: text only
        self.tokenizer = loading.load_tokenizer(tokenizer) if tokenizer is not None else None
        self.text_length = int(text_length)

    @torch.inference_mode()
    def caption(self, images: list[np.ndarray]) -> list[str]:
        """One caption per uint8 HWC image: greedy decoding, special tokens dropped, whitespace stripped."""
        if not images:
            return []
        kwargs = {"images": images, "return_tensors": "pt"}
        if self.prompt is not None:
            kwargs["text"] = [self.prompt] * len(images)
        inputs = {k: v.to(self.device, dtype=self.dtype if v.is_floating_point() else None)
                  for k, v in self.processor(**kwargs).items() if isinstance(v, torch.Tensor)}
        ids = self.model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=self.max_new_tokens)
        prompt_ids = inputs.get("input_ids")
        if prompt_ids is None:
            return [text.strip() for text in self.processor.batch_decode(ids, skip_special_tokens=True)]
        n = prompt_ids.shape[1]  # decoder-only models (LLaVA) echo the prompt's tokens: keep what follows
        if ids.shape[1] >= n and torch.equal(ids[:, :n], prompt_ids.to(ids.device)):
            ids = ids[:, n:]
        echo = self.processor.batch_decode(prompt_ids[:1], skip_special_tokens=True)[0].strip()
        texts = [text.strip() for text in self.processor.batch_decode(ids, skip_special_tokens=True)]
        # BLIP continues the prompt's text (its tokens re-marked): cut that too
        return [text[len(echo):].strip() if echo and text.startswith(echo) else text for text in texts]

    def __call__(self, batch: dict) -> dict:
        start = time.perf_counter()
        captions = self.caption(crops_of(batch, self.resolution))
        out = dict(batch)
        text, _, ids = schema.caption_columns(self.column)
        out[text] = np.array(captions, dtype=object)
        if self.tokenizer is not None:
            out[ids], out[schema.tokens_column(self.column)] = tokenize(self.tokenizer, captions, self.text_length)
        if self.record_timing:
            out[STAGE_SECONDS] = np.full(len(captions), (time.perf_counter() - start) / max(len(captions), 1))
        return out
