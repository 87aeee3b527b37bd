"""SANA's linear-attention DiT: diffusers' ``SanaTransformer2DModel``, built for DC-AE latents (32 channels,
/32), sampled with ``SanaPipeline``.

The model reads (B, C, H, W) latents (patches of 1 on DC-AE's small grids), the text encoder's last hidden
state (``caption_channels``: its width) through cross-attention, and the time as the pipeline passes it,
the flow level t in [0, 1000] times ``timestep_scale``. With a text mask (``model.text_mask``) the
cross-attention reads the caption's tokens only, through diffusers' own ``encoder_attention_mask``, which
``SanaPipeline`` also passes: an export samples masked models as trained. SANA itself reads Gemma-2's
states (2,304 wide, 300 tokens); the model reference's one text encoder stands in for it.

Patch masking and token routing are not adapted (``masking`` off: refused naming the key).
"""

from __future__ import annotations

import torch

from diffusion.models.denoisers.base import DenoiserAdapter
from diffusion.models.denoisers.sd3_transformer import prompt_conditioning

EMPTY_SLOTS = ("text_encoder", "tokenizer")  # SanaPipeline's Gemma slots, left empty (ours goes beside them)


class SanaTransformerAdapter(DenoiserAdapter):
    class_name = "SanaTransformer2DModel"
    component = "transformer"
    blocks = frozenset({"SanaTransformerBlock"})
    empty_slots = EMPTY_SLOTS
    pipeline_autoencoders = ("AutoencoderDC",)  # SanaPipeline reads DC-AE's config

    def text_dim(self, config):
        return int(config["caption_channels"])

    def __call__(self, module, noisy, timesteps, text, keep=None, mixer_blocks=0, route=None, route_span=None,
                 text_mask=None):
        if keep is not None or route is not None:
            raise ValueError("model.masking and model.routing are not adapted to the SANA transformer")
        masked = {"encoder_attention_mask": text_mask.to(noisy.dtype)} if text_mask is not None else {}
        return module(hidden_states=noisy, encoder_hidden_states=text.to(noisy.dtype),
                      timestep=timesteps * float(module.config.timestep_scale), **masked).sample

    def forward_flops(self, config, latent_size, text_dim, text_length, mask_ratio=0.0, mixer_blocks=0,
                      route_ratio=0.0, route_span=None):
        if mask_ratio or route_ratio:
            raise ValueError("model.masking and model.routing are not adapted to the SANA transformer")
        return super().forward_flops(config, latent_size, text_dim, text_length)

    # ---- sampling ------------------------------------------------------------------------------------
    def pipeline(self, module, *, vae, text_encoder, tokenizer, scheduler):
        from diffusers import SanaPipeline
        pipe = SanaPipeline(transformer=module, scheduler=scheduler, vae=vae, **dict.fromkeys(EMPTY_SLOTS))
        pipe.conditioning = (text_encoder, tokenizer)  # our encoder: the pipeline's slots are Gemma's
        return pipe

    def call_kwargs(self, guidance_scale: float, module=None) -> dict:
        # the aspect-ratio bins of the pipeline are SANA's published sizes: we sample the size asked for
        return {"guidance_scale": guidance_scale, "use_resolution_binning": False}

    def prompt_kwargs(self, pipe, prompts, negative_prompt, guidance_rescale, length=None, masked=False):
        text_encoder, tokenizer = pipe.conditioning
        embeds, _, mask = prompt_conditioning(text_encoder, tokenizer, prompts, length)
        negative, _, negative_mask = prompt_conditioning(text_encoder, tokenizer,
                                                         [negative_prompt or ""] * len(prompts), length)
        if not masked:  # the pipeline always passes a mask: all ones reads the padding, as training did
            mask, negative_mask = torch.ones_like(mask), torch.ones_like(negative_mask)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask.long(), "negative_prompt_embeds": negative,
                "negative_prompt_attention_mask": negative_mask.long(), "negative_prompt": None}  # its default: ""

    def mask_kwargs(self, mask, dtype):
        return {"encoder_attention_mask": mask.to(dtype)}


DENOISERS = {SanaTransformerAdapter.class_name: SanaTransformerAdapter()}
