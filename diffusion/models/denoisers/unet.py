"""SD2's denoiser: diffusers' ``UNet2DConditionModel``, sampled with ``StableDiffusionPipeline``."""

from __future__ import annotations

from diffusion.models.denoisers.base import DenoiserAdapter


class UNetAdapter(DenoiserAdapter):
    class_name = "UNet2DConditionModel"
    component = "unet"
    blocks = frozenset({"ResnetBlock2D", "BasicTransformerBlock"})
    channels_last = True

    def text_dim(self, config):
        return int(config["cross_attention_dim"])

    def __call__(self, module, noisy, timesteps, text, keep=None, mixer_blocks=0):
        if keep is not None:
            raise ValueError("model.masking needs a transformer denoiser: the UNet has no patches to drop")
        return module(noisy, timesteps, text.to(noisy.dtype)).sample

    def pipeline(self, module, *, vae, text_encoder, tokenizer, scheduler):
        from diffusers import StableDiffusionPipeline
        return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=module,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)

    def prompt_kwargs(self, pipe, prompts, negative_prompt, guidance_rescale):
        # With no negative prompt the pipeline's unconditional input is the embedding of "" padded to 77
        # tokens: exactly the empty-caption embedding training substitutes for dropped captions.
        return {"prompt": prompts, "guidance_rescale": guidance_rescale,
                "negative_prompt": [negative_prompt] * len(prompts) if negative_prompt else None}


DENOISERS = {UNetAdapter.class_name: UNetAdapter()}
