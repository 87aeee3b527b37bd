"""A trained SANA transformer samples DC-AE latents, exports as diffusers' SanaPipeline, and that pipeline
draws what our sampler draws, with the captions' attention masks where the model reads them."""

import contextlib
import dataclasses
import io

import numpy as np
import pytest
import torch

from diffusion.models import loading, sampling
from diffusion.sample import export, generate
from sampling_helpers import PROMPTS, pixels, run_printed_call, train_tiny_checkpoint


@pytest.fixture(scope="module")
def sana_export(tiny_sana_kit, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sana")
    space = loading.latent_space_of(loading.load_vae_config(tiny_sana_kit))
    checkpoint = train_tiny_checkpoint(tiny_sana_kit, str(folder / "ckpt"), "model.objective=flow",
                                       "model.prediction_type=null", batches=2, latent_space=space)
    out = str(folder / "pipe")
    with contextlib.redirect_stdout(io.StringIO()) as said:  # what the export tells the user to run
        export.main(["--checkpoint", checkpoint, "--out", out])
    return checkpoint, out, said.getvalue()


def _theirs(out, text_mask: bool, seed: int):
    from diffusers import DiffusionPipeline, SanaPipeline
    from diffusion.models.denoisers.sana_transformer import EMPTY_SLOTS
    from diffusion.models.denoisers.sd3_transformer import prompt_conditioning
    pipe = DiffusionPipeline.from_pretrained(out, **dict.fromkeys(EMPTY_SLOTS))
    assert isinstance(pipe, SanaPipeline)
    text_encoder, tokenizer = loading.load_text_encoder(out), loading.load_tokenizer(out)
    embeds, _, mask = prompt_conditioning(text_encoder, tokenizer, PROMPTS[:1])
    empty, _, empty_mask = prompt_conditioning(text_encoder, tokenizer, [""])
    if not text_mask:
        mask, empty_mask = torch.ones_like(mask), torch.ones_like(empty_mask)
    return pipe(prompt_embeds=embeds, prompt_attention_mask=mask.long(), negative_prompt_embeds=empty,
                negative_prompt_attention_mask=empty_mask.long(), negative_prompt=None, guidance_scale=4.0,
                num_inference_steps=3, height=64, width=64, use_resolution_binning=False,
                generator=[torch.Generator("cpu").manual_seed(seed)]).images[0]


def test_sana_export_loads_as_sana_pipeline_and_draws_what_generate_draws(sana_export):
    checkpoint, out, said = sana_export
    trained = sampling.load_trained(checkpoint)
    assert type(trained.denoiser).__name__ == "SanaTransformer2DModel"
    ours = generate.generate_images(checkpoint, PROMPTS[:1], steps=3, guidance_scale=4.0, seed=3)[0]
    assert ours.size == (64, 64)
    assert np.abs(pixels(_theirs(out, False, 3)) - pixels(ours)).max() <= 1
    again = generate.generate_images(out, PROMPTS[:1], steps=3, guidance_scale=4.0, seed=3, size=64)[0]
    assert np.abs(pixels(again) - pixels(ours)).max() <= 1
    # the lines export prints run as written: the pipeline's defaults (resolution binning, 1024 px, a
    # negative_prompt beside our embeddings, no masks) would not draw this model's image
    assert "use_resolution_binning=False" in said and "height=64, width=64" in said, said
    image = run_printed_call(said, seed=5)
    trained = generate.generate_images(checkpoint, ["a prompt"], steps=20, guidance_scale=4.0, seed=5)[0]
    assert image.size == (64, 64) and np.abs(pixels(image) - pixels(trained)).max() <= 1


def test_a_masked_sana_samples_with_the_captions_masks_in_both(sana_export):
    checkpoint, out, _ = sana_export
    trained = sampling.load_trained(checkpoint)
    masked = dataclasses.replace(trained.description, text_mask=True)  # as a model trained with masks
    ours = sampling.Sampler(masked)(trained.denoiser, PROMPTS[:1], steps=3, guidance_scale=4.0, seed=3)[0]
    plain = sampling.Sampler(trained.description)(trained.denoiser, PROMPTS[:1], steps=3, guidance_scale=4.0, seed=3)[0]
    assert np.abs(pixels(_theirs(out, True, 3)) - pixels(ours)).max() <= 1
    assert np.abs(pixels(plain) - pixels(ours)).max() > 1  # the masks change what it draws
