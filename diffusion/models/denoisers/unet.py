"""SD2's denoiser: diffusers' ``UNet2DConditionModel``, sampled with ``StableDiffusionPipeline``."""

from __future__ import annotations

from diffusion.models import loading
from diffusion.models.denoisers.base import DenoiserAdapter


class UNetAdapter(DenoiserAdapter):
    class_name = "UNet2DConditionModel"
    component = "unet"
    blocks = frozenset({"ResnetBlock2D", "BasicTransformerBlock"})
    channels_last = True

    def text_dim(self, config):
        return int(config["cross_attention_dim"])

    def __call__(self, module, noisy, timesteps, text, keep=None, mixer_blocks=0, text_mask=None):
        if keep is not None:
            raise ValueError("model.masking needs a transformer denoiser: the UNet has no patches to drop")
        if text_mask is None:
            return module(noisy, timesteps, text.to(noisy.dtype)).sample
        # diffusers' cross-attention mask: 1 keeps a text token, 0 drops it (made an additive bias inside)
        return module(noisy, timesteps, text.to(noisy.dtype), encoder_attention_mask=text_mask.to(noisy.dtype)).sample

    def pipeline(self, module, *, vae, text_encoder, tokenizer, scheduler):
        from diffusers import StableDiffusionPipeline
        return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=module,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)

    def prompt_kwargs(self, pipe, prompts, negative_prompt, guidance_rescale, length=None, masked=False):
        clip = not loading.text_encoder_takes_mask(pipe.text_encoder.config.model_type)
        if clip and not masked and length in (None, pipe.tokenizer.model_max_length):
            # SD2: with no negative prompt the pipeline's unconditional input is the embedding of "" padded
            # to 77 tokens: exactly the empty-caption embedding training substitutes for dropped captions.
            return {"prompt": prompts, "guidance_rescale": guidance_rescale,
                    "negative_prompt": [negative_prompt] * len(prompts) if negative_prompt else None}
        # Another text length or encoder (T5 reads its mask; the pipeline would not give it one): the
        # embeddings as training's conditioning made them.
        from diffusion.models.denoisers.sd3_transformer import prompt_conditioning
        embeds, _, mask = prompt_conditioning(pipe.text_encoder, pipe.tokenizer, prompts, length)
        negative, _, negative_mask = prompt_conditioning(pipe.text_encoder, pipe.tokenizer,
                                                         [negative_prompt or ""] * len(prompts), length)
        kwargs = {"prompt_embeds": embeds, "negative_prompt_embeds": negative, "guidance_rescale": guidance_rescale}
        if masked:
            kwargs["text_masks"] = (negative_mask, mask)
        return kwargs

    def mask_kwargs(self, mask, dtype):
        return {"encoder_attention_mask": mask.to(dtype)}


DENOISERS = {UNetAdapter.class_name: UNetAdapter()}
