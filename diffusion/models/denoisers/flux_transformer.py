"""Flux.1's MMDiT: diffusers' ``FluxTransformer2DModel``, double-stream then single-stream blocks with rotary
positions, sampled with ``FluxPipeline``.

The model reads **packed** latents: each 2x2 patch of a C-channel latent is one token of 4C channels
(``in_channels`` = 4C: 64 for Flux's 16-channel VAE), placed by its position ids (0, row, column); the text
tokens' ids are zeros. The adapter packs a batch of (B, C, H, W) latents, calls the model and unpacks its
prediction, with the pipeline's own static helpers, so training and ``FluxPipeline`` see the same layout.
The time is the noise level σ = t / 1000 (the model multiplies it by 1000 itself, as the pipeline passes it).
Guidance embedding off, as in Flux.1-schnell: sampling guides with true classifier-free guidance
(``true_cfg_scale``, the negative prompt's prediction in a second call). Flux.1-dev's shape
(``guidance_embeds: true``, guidance-distilled) trains with one guidance value in that embedding for every
sample, ``model.embedded_guidance`` (default 1.0; diffusers' Flux training scripts pass ``--guidance_scale``
the same way), and samples with that value as FluxPipeline's embedded guidance (its ``guidance_scale``, whose
default 3.5 the model never read) beside the true classifier-free guidance above.

Conditioning, as Flux.1 is: with a model reference in FluxPipeline's layout of two text encoders (CLIP in
``text_encoder/``, T5 in ``text_encoder_2/``, as the tiny-flux kit has), T5's last hidden state as
``encoder_hidden_states`` (``joint_attention_dim``) and CLIP's pooled vector as ``pooled_projections``
(``pooled_projection_dim``): the converter stores it (``pooled_text_embeds``), training passes it (``pooled=``),
and sampling calls FluxPipeline with both encoders, so an export is called with a prompt string. With one text
encoder (the MMDiT recipe's data, the flux-schnell configs), as for the SD3 MMDiT
(:mod:`diffusion.models.denoisers.sd3_transformer`): its sequence, and its mean over the tokens as the pooled
vector (``pooled_projection_dim`` = the same width). With a text mask
(``model.text_mask``) every attention reads the caption's tokens only (:func:`masked_attention_class`).
Patch masking and token routing are not adapted (``masking`` off: refused naming the key).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from diffusion.models.denoisers.base import DenoiserAdapter
from diffusion.models.denoisers.sd3_transformer import EMPTY_SLOTS as _SD3_SLOTS, prompt_conditioning
from diffusion.models.denoisers.sd3_transformer import pooled as mean_pooled

# FluxPipeline's two text-encoder slots, left empty (ours goes beside them, as for SD3): load an export with
# ``FluxPipeline.from_pretrained(DIR, **dict.fromkeys(EMPTY_SLOTS))``.
EMPTY_SLOTS = tuple(slot for slot in _SD3_SLOTS if not slot.endswith("_3"))


def _pipeline_class():
    # from its own module: ``diffusers`` and ``diffusers.pipelines`` are lazy modules, which torch.compile
    # cannot import inside a traced step (a graph break at every call)
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
    return FluxPipeline


def pack(latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C, H, W) → (packed (B, H/2·W/2, 4C), image position ids (H/2·W/2, 3)), as ``FluxPipeline`` does."""
    b, c, h, w = latents.shape
    flux = _pipeline_class()
    ids = flux._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)
    return flux._pack_latents(latents, b, c, h, w), ids


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed (B, H/2·W/2, 4C) → (B, C, H, W) latents (sides in latent pixels)."""
    return _pipeline_class()._unpack_latents(tokens, height, width, 1)


@functools.lru_cache(maxsize=1)
def masked_attention_class():
    """``MaskedFluxAttention``: Flux's attention with a text mask, ``attention_mask`` (B, L) bool over the text
    tokens, True on the caption's, widened here to the joint sequence (text first, then every image token,
    as both block kinds order them) so no query reads a padded text key; without a mask it is diffusers'
    own computation. Defined on first use: diffusers loads only where a model does."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    class MaskedFluxAttention(FluxAttnProcessor):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     image_rotary_emb=None):
            if attention_mask is not None and attention_mask.ndim == 2:
                text = attention_mask.shape[1]
                total = hidden_states.shape[1] + (0 if encoder_hidden_states is None else encoder_hidden_states.shape[1])
                joint = attention_mask.new_ones(attention_mask.shape[0], total, dtype=torch.bool)
                joint[:, :text] = attention_mask.to(torch.bool)
                attention_mask = joint[:, None, None, :]
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
    return MaskedFluxAttention


class FluxTransformerAdapter(DenoiserAdapter):
    class_name = "FluxTransformer2DModel"
    component = "transformer"
    blocks = frozenset({"FluxTransformerBlock", "FluxSingleTransformerBlock"})
    empty_slots = EMPTY_SLOTS
    cfg_argument = "true_cfg_scale"  # no guidance embedding: true classifier-free guidance
    packing = 2  # FluxPipeline packs 2x2 latent pixels into a token
    passes_sigmas = True
    pooled_text = True  # CLIP's pooled vector where the model reference has Flux's two text encoders

    def latent_channels(self, config):
        return int(config["in_channels"]) // 4  # 2x2 patches packed into the channels

    def text_dim(self, config):
        return int(config["joint_attention_dim"])

    def pooled_dim(self, config):
        return int(config["pooled_projection_dim"])

    def enable_text_mask(self, module):
        module.set_attn_processor(masked_attention_class()())

    def __call__(self, module, noisy, timesteps, text, keep=None, mixer_blocks=0, route=None, route_span=None,
                 text_mask=None, pooled=None):
        if keep is not None or route is not None:
            raise ValueError("model.masking and model.routing are not adapted to the Flux transformer")
        height, width = noisy.shape[-2:]
        tokens, image_ids = pack(noisy)
        text = text.to(noisy.dtype)
        text_ids = torch.zeros(text.shape[1], 3, device=noisy.device, dtype=noisy.dtype)
        masked = {"joint_attention_kwargs": {"attention_mask": text_mask}} if text_mask is not None else {}
        pooled = mean_pooled(text, text_mask) if pooled is None else pooled.to(noisy.dtype)
        guidance = None  # Flux.1-dev's shape: one guidance value for every sample (model.embedded_guidance)
        if module.config.guidance_embeds:
            guidance = torch.full((tokens.shape[0],), float(getattr(module, "embedded_guidance", 1.0)),
                                  device=noisy.device, dtype=noisy.dtype)
        out = module(hidden_states=tokens, encoder_hidden_states=text, pooled_projections=pooled,
                     timestep=timesteps.to(noisy.dtype) / 1000, img_ids=image_ids, txt_ids=text_ids,
                     guidance=guidance, **masked).sample
        return unpack(out, height, width)

    def sample_size(self, module) -> int:
        return int(getattr(module.config, "sample_size", 128))  # FluxPipeline's default: 128 latent pixels

    def forward_flops(self, config, latent_size, text_dim, text_length, mask_ratio=0.0, mixer_blocks=0,
                      route_ratio=0.0, route_span=None):
        if mask_ratio or route_ratio:
            raise ValueError("model.masking and model.routing are not adapted to the Flux transformer")
        return super().forward_flops(config, latent_size, text_dim, text_length)

    # ---- sampling ------------------------------------------------------------------------------------
    def pipeline(self, module, *, vae, text_encoder, tokenizer, scheduler, pooled_encoder=None):
        if pooled_encoder is not None:  # Flux's two text encoders, in the pipeline's own slots: CLIP, then T5
            clip, clip_tokenizer = pooled_encoder
            return _pipeline_class()(transformer=module, scheduler=scheduler, vae=vae, text_encoder=clip,
                                     tokenizer=clip_tokenizer, text_encoder_2=text_encoder, tokenizer_2=tokenizer)
        pipe = _pipeline_class()(transformer=module, scheduler=scheduler, vae=vae, **dict.fromkeys(EMPTY_SLOTS))
        pipe.conditioning = (text_encoder, tokenizer)  # our encoder: the pipeline's slots are CLIP's and T5's
        return pipe

    pipeline_shift = True  # FluxPipeline adds the shift back

    def call_kwargs(self, guidance_scale, module=None):
        kwargs = super().call_kwargs(guidance_scale)
        if module is not None and getattr(module, "config", {}).get("guidance_embeds"):  # the value it was trained with
            kwargs["guidance_scale"] = float(getattr(module, "embedded_guidance", 1.0))
        return kwargs

    def unpack(self, pipe, latents, height, width):
        return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)

    def prompt_kwargs(self, pipe, prompts, negative_prompt, guidance_rescale, length=None, masked=False):
        if getattr(pipe, "text_encoder_2", None) is not None:
            return self._two_encoder_kwargs(pipe, prompts, negative_prompt, length, masked)
        text_encoder, tokenizer = pipe.conditioning
        embeds, pooled_embeds, mask = prompt_conditioning(text_encoder, tokenizer, prompts, length, masked)
        negative, negative_pooled, negative_mask = prompt_conditioning(
            text_encoder, tokenizer, [negative_prompt or ""] * len(prompts), length, masked)
        kwargs = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled_embeds, "negative_prompt_embeds": negative,
                  "negative_pooled_prompt_embeds": negative_pooled}
        if masked:
            kwargs["text_masks"] = (negative_mask, mask, negative)
        return kwargs

    def _two_encoder_kwargs(self, pipe, prompts, negative_prompt, length, masked):
        """FluxPipeline's own prompt encoding (T5's sequence padded to ``length``, CLIP's pooled vector): what the
        converter stored, and what a call of the exported pipeline with a prompt string computes."""
        length = length or pipe.tokenizer_max_length
        negatives = [negative_prompt or ""] * len(prompts)
        embeds, pooled_embeds, _ = pipe.encode_prompt(prompts, None, max_sequence_length=length)
        negative, negative_pooled, _ = pipe.encode_prompt(negatives, None, max_sequence_length=length)
        kwargs = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled_embeds, "negative_prompt_embeds": negative,
                  "negative_pooled_prompt_embeds": negative_pooled, "max_sequence_length": length}
        if masked:
            from diffusion.models.text_encoder import attention_mask, tokenize
            counts = [torch.from_numpy(tokenize(pipe.tokenizer_2, texts, length)[1]) for texts in (negatives, prompts)]
            negative_mask, mask = (attention_mask(c, length).to(embeds.device) for c in counts)
            kwargs["text_masks"] = (negative_mask, mask, negative)
        return kwargs

    def mask_kwargs(self, mask, dtype):
        return {"joint_attention_kwargs": {"attention_mask": mask}}

    @contextlib.contextmanager
    def text_mask_hook(self, module, masks):
        """FluxPipeline runs the negative prompt in a call of its own: each call gets the mask of the
        prompts whose embeddings it reads (the negative ones are recognised by value)."""
        if masks is None:
            yield
            return
        negative_mask, positive_mask, negative = masks

        def inject(_, args, kwargs):
            states = kwargs["encoder_hidden_states"]
            reads_negative = states.shape == negative.shape and torch.equal(states, negative.to(states))
            mask = negative_mask if reads_negative else positive_mask
            return args, {**kwargs, **self.mask_kwargs(mask.to(states.device), states.dtype)}

        handle = module.register_forward_pre_hook(inject, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


DENOISERS = {FluxTransformerAdapter.class_name: FluxTransformerAdapter()}
