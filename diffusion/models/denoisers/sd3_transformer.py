"""The MMDiT of SD3 (Esser et al. 2024): diffusers' ``SD3Transformer2DModel``, joint text-image attention.

Conditioning: the text encoder's last hidden state (what the converter stores, or what the frozen text
encoder computes from token ids) as ``encoder_hidden_states`` (``joint_attention_dim`` = its width), and
its mean over the tokens as ``pooled_projections`` (``pooled_projection_dim`` = the same width). With
a text mask (``model.text_mask``: T5's long, padded captions) every joint attention reads the caption's
tokens only, through :class:`MaskedJointAttention`, and the pooled vector is the mean over them. SD3
itself feeds two CLIPs and a T5; one text encoder keeps the data contract of the UNet recipe, so both
train on the same converted data.

Sampling uses diffusers' ``StableDiffusion3Pipeline`` with the prompt embeddings computed here (its own
prompt encoding expects SD3's three encoders); an exported directory loads into that class with those
slots passed as None (:data:`EMPTY_SLOTS`), and :func:`encode_prompts` gives the embeddings to call it with.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from diffusion.models.denoisers.base import DenoiserAdapter
from diffusion.models.masking import patch_mask


# SD3's three text-encoder slots, which our pipelines leave empty: diffusers loads such a directory when
# they are passed as None, e.g. ``DiffusionPipeline.from_pretrained(DIR, **dict.fromkeys(EMPTY_SLOTS))``.
EMPTY_SLOTS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")


def pooled(text: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The pooled text vector: the mean of the token states (with ``mask``, of the caption's tokens)."""
    if mask is None:
        return text.mean(dim=1)
    weights = mask.to(text.dtype)[..., None]
    return (text * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


class MaskedJointAttention:
    """SD3's joint attention (diffusers' ``JointAttnProcessor2_0`` computes the same) with a text mask:
    image and text tokens attend together, and no query reads a key of the text's padding.

    ``attention_mask`` is (B, L) bool over the text tokens, True on the caption's (the model call's
    ``joint_attention_kwargs``); image tokens are always read, whatever their number (masked patches cut
    it), so no row is empty. Without a mask, or in an image-only attention, it is the plain computation.
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        batch, image_tokens = hidden_states.shape[:2]

        def heads(x, norm=None):
            x = x.view(batch, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)
            return norm(x) if norm is not None else x

        query = heads(attn.to_q(hidden_states), attn.norm_q)
        key = heads(attn.to_k(hidden_states), attn.norm_k)
        value = heads(attn.to_v(hidden_states))
        keep = None
        if encoder_hidden_states is not None:
            query = torch.cat([query, heads(attn.add_q_proj(encoder_hidden_states), attn.norm_added_q)], dim=2)
            key = torch.cat([key, heads(attn.add_k_proj(encoder_hidden_states), attn.norm_added_k)], dim=2)
            value = torch.cat([value, heads(attn.add_v_proj(encoder_hidden_states))], dim=2)
            if attention_mask is not None:
                image = attention_mask.new_ones(batch, image_tokens)
                keep = torch.cat([image, attention_mask.to(torch.bool)], dim=1)[:, None, None, :]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=keep, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * out.shape[-1]).to(query.dtype)
        image_out = attn.to_out[1](attn.to_out[0](out[:, :image_tokens]))
        if encoder_hidden_states is None:
            return image_out
        text_out = out[:, image_tokens:]
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return image_out, text_out


def encode_prompts(text_encoder, tokenizer, prompts: list[str], length: int | None = None,
                   masked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_embeds, pooled_prompt_embeds)`` for ``StableDiffusion3Pipeline``: the prompts padded to
    ``length`` tokens (the tokenizer's own by default) and encoded as training's conditioning is (the
    pooled vector over the caption's tokens when ``masked``)."""
    embeds, pooled_embeds, _ = prompt_conditioning(text_encoder, tokenizer, prompts, length, masked)
    return embeds, pooled_embeds


@torch.no_grad()
def prompt_conditioning(text_encoder, tokenizer, prompts: list[str], length: int | None = None,
                        masked: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`encode_prompts` and the prompts' text mask ((B, L) bool, True on their tokens)."""
    from diffusion.models import loading
    from diffusion.models.text_encoder import attention_mask, tokenize
    ids, counts = tokenize(tokenizer, prompts, length or tokenizer.model_max_length)
    ids, counts = torch.from_numpy(ids).long(), torch.from_numpy(counts)
    mask = attention_mask(counts, ids.shape[1]).to(text_encoder.device)
    reads = mask.long() if loading.text_encoder_takes_mask(text_encoder.config.model_type) else None
    states = text_encoder(ids.to(text_encoder.device), attention_mask=reads)[0]
    return states, pooled(states, mask if masked else None), mask


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
    empty_slots = EMPTY_SLOTS

    def text_dim(self, config):
        return int(config["joint_attention_dim"])

    def patch_size(self, config) -> int:
        return int(config["patch_size"])

    def loss_mask(self, module, keep, shape):
        return patch_mask(keep, shape, int(module.config.patch_size))

    masking = True

    def route_span(self, module, span):
        return resolve_span(len(module.transformer_blocks), span)

    def enable_text_mask(self, module):
        module.set_attn_processor(MaskedJointAttention())

    def __call__(self, module, noisy, timesteps, text, keep=None, mixer_blocks=0, route=None, route_span=None,
                 text_mask=None):
        text = text.to(noisy.dtype)
        masked = {"joint_attention_kwargs": {"attention_mask": text_mask}} if text_mask is not None else {}
        with _masked(module, keep, mixer_blocks, noisy.shape), _routed(module, route, route_span):
            return module(hidden_states=noisy, encoder_hidden_states=text, pooled_projections=pooled(text, text_mask),
                          timestep=timesteps, **masked).sample

    def pipeline(self, module, *, vae, text_encoder, tokenizer, scheduler):
        from diffusers import StableDiffusion3Pipeline
        if vae is not None and vae.config.get("shift_factor") is None:  # SD3's decode adds it; SD's VAE has none
            vae.register_to_config(shift_factor=0.0)
        pipe = StableDiffusion3Pipeline(transformer=module, scheduler=scheduler, vae=vae,
                                        **dict.fromkeys(EMPTY_SLOTS))
        pipe.conditioning = (text_encoder, tokenizer)  # our encoder: the pipeline's slots are SD3's three
        return pipe

    pipeline_shift = True  # SD3's pipeline adds the shift back

    def prompt_kwargs(self, pipe, prompts, negative_prompt, guidance_rescale, length=None, masked=False):
        text_encoder, tokenizer = pipe.conditioning
        embeds, pooled_embeds, mask = prompt_conditioning(text_encoder, tokenizer, prompts, length, masked)
        negative, negative_pooled, negative_mask = prompt_conditioning(
            text_encoder, tokenizer, [negative_prompt or ""] * len(prompts), length, masked)
        kwargs = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled_embeds,
                  "negative_prompt_embeds": negative, "negative_pooled_prompt_embeds": negative_pooled,
                  "max_sequence_length": embeds.shape[1]}
        if masked:
            kwargs["text_masks"] = (negative_mask, mask)
        return kwargs

    def mask_kwargs(self, mask, dtype):
        return {"joint_attention_kwargs": {"attention_mask": mask}}


DENOISERS = {SD3TransformerAdapter.class_name: SD3TransformerAdapter()}
