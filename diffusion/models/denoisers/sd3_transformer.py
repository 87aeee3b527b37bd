"""The MMDiT of SD3 (Esser et al. 2024): diffusers' ``SD3Transformer2DModel``, joint text-image attention.

Conditioning: the text encoder's last hidden state (what the converter stores, or what the frozen text
encoder computes from token ids) as ``encoder_hidden_states`` (``joint_attention_dim`` = its width), and
its mean over the tokens as ``pooled_projections`` (``pooled_projection_dim`` = the same width). SD3
itself feeds two CLIPs and a T5; one text encoder keeps the data contract of the UNet recipe, so both
train on the same converted data.

Sampling uses diffusers' ``StableDiffusion3Pipeline`` with the prompt embeddings computed here (its own
prompt encoding expects SD3's three encoders); an exported directory loads into that class with those
slots passed as None (:data:`EMPTY_SLOTS`), and :func:`encode_prompts` gives the embeddings to call it with.
"""

from __future__ import annotations

import contextlib

import torch

from diffusion.models.denoisers.base import DenoiserAdapter
from diffusion import schema
from diffusion.models.masking import patch_mask


# SD3's three text-encoder slots, which our pipelines leave empty: diffusers loads such a directory when
# they are passed as None, e.g. ``DiffusionPipeline.from_pretrained(DIR, **dict.fromkeys(EMPTY_SLOTS))``.
EMPTY_SLOTS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")


def pooled(text: torch.Tensor) -> torch.Tensor:
    """The pooled text vector: the mean of the token states."""
    return text.mean(dim=1)


@torch.no_grad()
def encode_prompts(text_encoder, tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_embeds, pooled_prompt_embeds)`` for ``StableDiffusion3Pipeline``: the prompts padded to
    the tokenizer's length and encoded as training's conditioning is."""
    ids = tokenizer(list(prompts), padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids
    states = text_encoder(ids.to(text_encoder.device))[0]
    return states, pooled(states)


@contextlib.contextmanager
def _masked(module, keep, mixer_blocks: int, shape):
    """Deferred patch masking (MicroDiT) inside the model's own forward: the first ``mixer_blocks`` joint
    blocks (the patch mixer) see every patch; before the next one, each sample's image tokens are cut to
    the patches ``keep`` lists; after the output projection the kept tokens are put back in place (the
    dropped ones zero) so the model's own unpatchify runs. Hooks, not a copy of the forward: FSDP's
    gathers, the blocks and the text stream are the model's; ``keep`` None is the plain forward."""
    if keep is None:
        yield
        return
    blocks = module.transformer_blocks
    if not 0 < mixer_blocks < len(blocks):
        raise ValueError(f"model.masking.mixer_blocks={mixer_blocks}: the MMDiT has {len(blocks)} blocks; the mixer "
                         f"takes 1 to {len(blocks) - 1} of them, the rest see the kept patches")
    patch = module.config.patch_size
    patches = (shape[-2] // patch) * (shape[-1] // patch)
    index = keep.to(torch.long)

    def cut(block, args, kwargs):
        tokens = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        kept = tokens.gather(1, index[..., None].expand(-1, -1, tokens.shape[-1]))
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": kept}
        return (kept, *args[1:]), kwargs

    def put_back(projection, args, output):
        full = output.new_zeros(output.shape[0], patches, output.shape[-1])
        return full.scatter(1, index[..., None].expand(-1, -1, output.shape[-1]), output)

    handles = [blocks[mixer_blocks].register_forward_pre_hook(cut, with_kwargs=True),
               module.proj_out.register_forward_hook(put_back)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def resolve_span(blocks: int, span: tuple[int, int]) -> tuple[int, int]:
    """``model.routing``'s (start, end) as block indices; ``end`` below 1 counts from the last block."""
    start, end = int(span[0]), int(span[1])
    end = end if end > 0 else blocks + end
    if not 0 <= start < end <= blocks:
        raise ValueError(f"model.routing.start={span[0]}, end={span[1]}: the MMDiT has {blocks} blocks; the routed "
                         f"span must hold at least one of them (0 <= start < end <= {blocks}; end <= 0 counts from "
                         f"the last)")
    return start, end


@contextlib.contextmanager
def _routed(module, route, span):
    """Token routing (TREAD) inside the model's own forward: before block ``start`` each sample's image
    tokens are cut to the patches ``route`` lists; after block ``end - 1`` the tokens that went through
    are put back among the others, which skipped the span unchanged. Every patch reaches the output
    layer. Hooks, as for masking; ``route`` None is the plain forward."""
    if route is None:
        yield
        return
    blocks = module.transformer_blocks
    start, end = resolve_span(len(blocks), span)
    index = route.to(torch.long)
    entering = {}  # the image tokens at the span's start (kept, not popped: checkpointing recomputes blocks)

    def cut(block, args, kwargs):
        tokens = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        entering["tokens"] = tokens
        kept = tokens.gather(1, index[..., None].expand(-1, -1, tokens.shape[-1]))
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": kept}
        return (kept, *args[1:]), kwargs

    def rejoin(block, args, kwargs, output):
        text, image = output
        return text, entering["tokens"].scatter(1, index[..., None].expand(-1, -1, image.shape[-1]), image)

    handles = [blocks[start].register_forward_pre_hook(cut, with_kwargs=True),
               blocks[end - 1].register_forward_hook(rejoin, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class SD3TransformerAdapter(DenoiserAdapter):
    class_name = "SD3Transformer2DModel"
    component = "transformer"
    blocks = frozenset({"JointTransformerBlock"})

    def text_dim(self, config):
        return int(config["joint_attention_dim"])

    def patch_size(self, config) -> int:
        return int(config["patch_size"])

    def loss_mask(self, module, keep, shape):
        return patch_mask(keep, shape, int(module.config.patch_size))

    masking = True

    def route_span(self, module, span):
        return resolve_span(len(module.transformer_blocks), span)

    def __call__(self, module, noisy, timesteps, text, keep=None, mixer_blocks=0, route=None, route_span=None):
        text = text.to(noisy.dtype)
        with _masked(module, keep, mixer_blocks, noisy.shape), _routed(module, route, route_span):
            return module(hidden_states=noisy, encoder_hidden_states=text, pooled_projections=pooled(text),
                          timestep=timesteps).sample

    def pipeline(self, module, *, vae, text_encoder, tokenizer, scheduler):
        from diffusers import StableDiffusion3Pipeline
        if vae.config.get("shift_factor") is None:  # SD3's decode adds it; SD-family VAEs have none
            vae.register_to_config(shift_factor=0.0)
        pipe = StableDiffusion3Pipeline(transformer=module, scheduler=scheduler, vae=vae,
                                        **dict.fromkeys(EMPTY_SLOTS))
        pipe.conditioning = (text_encoder, tokenizer)  # our encoder: the pipeline's slots are SD3's three
        return pipe

    def prompt_kwargs(self, pipe, prompts, negative_prompt, guidance_rescale):
        text_encoder, tokenizer = pipe.conditioning
        embeds, pooled_embeds = encode_prompts(text_encoder, tokenizer, prompts)
        negative, negative_pooled = encode_prompts(text_encoder, tokenizer, [negative_prompt or ""] * len(prompts))
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled_embeds,
                "negative_prompt_embeds": negative, "negative_pooled_prompt_embeds": negative_pooled,
                "max_sequence_length": schema.MAX_TOKENS}


DENOISERS = {SD3TransformerAdapter.class_name: SD3TransformerAdapter()}
