"""A trained Flux transformer samples, exports as diffusers' FluxPipeline, and that pipeline draws what our
sampler draws (true classifier-free guidance, 2x2-packed latents, the 16-channel VAE's shift)."""

import numpy as np
import pytest
import torch

from diffusion.models import loading, sampling
from diffusion.sample import export, generate
from sampling_helpers import PROMPTS, pixels, train_tiny_checkpoint


@pytest.fixture(scope="module")
def flux_checkpoint(tiny_flux_kit, tmp_path_factory):
    space = loading.latent_space_of(loading.load_vae_config(tiny_flux_kit))
    return train_tiny_checkpoint(tiny_flux_kit, str(tmp_path_factory.mktemp("flux_ckpt")), "model.objective=flow",
                                 "model.prediction_type=null", "model.flow.shift=2.0", batches=2, latent_space=space)


def test_flux_export_loads_as_flux_pipeline_and_draws_what_generate_draws(flux_checkpoint, tmp_path):
    from diffusers import DiffusionPipeline, FluxPipeline
    from diffusion.models.denoisers.flux_transformer import EMPTY_SLOTS
    from diffusion.models.denoisers.sd3_transformer import encode_prompts
    trained = sampling.load_trained(flux_checkpoint)
    assert type(trained.denoiser).__name__ == "FluxTransformer2DModel" and trained.description.objective == "flow"
    ours = generate.generate_images(flux_checkpoint, PROMPTS[:1], steps=3, guidance_scale=4.0, seed=7)[0]
    batched = generate.generate_images(flux_checkpoint, PROMPTS, steps=3, guidance_scale=4.0, seed=7)
    assert ours.size == (64, 64) and np.abs(pixels(batched[0]) - pixels(ours)).max() <= 1
    out = str(tmp_path / "pipe")
    export.main(["--checkpoint", flux_checkpoint, "--out", out])
    pipe = DiffusionPipeline.from_pretrained(out, **dict.fromkeys(EMPTY_SLOTS))
    assert isinstance(pipe, FluxPipeline) and pipe.scheduler.config.shift == 2.0
    text_encoder, tokenizer = loading.load_text_encoder(out), loading.load_tokenizer(out)
    embeds, pooled = encode_prompts(text_encoder, tokenizer, PROMPTS[:1])
    empty, empty_pooled = encode_prompts(text_encoder, tokenizer, [""])
    theirs = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=empty,
                  negative_pooled_prompt_embeds=empty_pooled, true_cfg_scale=4.0, num_inference_steps=3,
                  height=64, width=64, generator=[torch.Generator("cpu").manual_seed(7)]).images[0]
    assert np.abs(pixels(theirs) - pixels(ours)).max() <= 1
    again = generate.generate_images(out, PROMPTS[:1], steps=3, guidance_scale=4.0, seed=7, size=64)[0]
    assert np.abs(pixels(again) - pixels(ours)).max() <= 1
