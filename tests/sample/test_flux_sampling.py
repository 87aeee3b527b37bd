"""A trained Flux transformer samples, exports as diffusers' FluxPipeline, and that pipeline draws what our
sampler draws (true classifier-free guidance, 2x2-packed latents, the 16-channel VAE's shift): the tiny-flux
kit's two text encoders in the pipeline's own slots, so it is called with a prompt string."""

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


def test_flux_export_loads_as_flux_pipeline_and_draws_what_generate_draws(flux_checkpoint, tmp_path, capsys):
    from diffusers import DiffusionPipeline, FluxPipeline
    trained = sampling.load_trained(flux_checkpoint)
    assert type(trained.denoiser).__name__ == "FluxTransformer2DModel" and trained.description.objective == "flow"
    assert trained.description.pooled_text  # trained on CLIP's pooled vector beside T5's sequence
    ours = generate.generate_images(flux_checkpoint, PROMPTS[:1], steps=3, guidance_scale=4.0, seed=7)[0]
    batched = generate.generate_images(flux_checkpoint, PROMPTS, steps=3, guidance_scale=4.0, seed=7)
    assert ours.size == (64, 64) and np.abs(pixels(batched[0]) - pixels(ours)).max() <= 1
    out = str(tmp_path / "pipe")
    export.main(["--checkpoint", flux_checkpoint, "--out", out])
    said = capsys.readouterr().out  # how to call it: a prompt string, as trained
    assert "=None" not in said and 'negative_prompt=""' in said and "max_sequence_length=77" in said
    pipe = DiffusionPipeline.from_pretrained(out)  # every slot filled: CLIP and T5, each with its tokenizer
    assert isinstance(pipe, FluxPipeline) and pipe.scheduler.config.shift == 2.0
    assert type(pipe.text_encoder).__name__ == "CLIPTextModel" and type(pipe.text_encoder_2).__name__ == "T5EncoderModel"
    theirs = pipe(PROMPTS[0], negative_prompt="", true_cfg_scale=4.0, max_sequence_length=77, num_inference_steps=3,
                  height=64, width=64, generator=[torch.Generator("cpu").manual_seed(7)]).images[0]
    assert np.abs(pixels(theirs) - pixels(ours)).max() <= 1
    # the call export prints works as written, at the trained size (diffusers' default would draw 1024 px)
    [call] = [part for part in said.split("e.g. ", 1)[1:]]
    call = call.split(", as diffusion.generate does")[0]
    assert call.startswith('pipe("a prompt", height=64, width=64, '), said
    assert eval(call, {"pipe": pipe}).size == (64, 64)
    again = generate.generate_images(out, PROMPTS[:1], steps=3, guidance_scale=4.0, seed=7, size=64)[0]
    assert np.abs(pixels(again) - pixels(ours)).max() <= 1


def test_a_checkpoint_and_a_reference_of_other_text_encoders_are_refused_in_one_line(tiny_flux_kit):
    """A Flux checkpoint trained on one text encoder (the mean of its sequence pooled: before tiny-flux had two)
    does not sample with the two-encoder kit, nor the other way round."""
    import dataclasses
    from diffusion.errors import ModelReferenceError
    described = sampling.describe_reference(tiny_flux_kit)
    assert described.pooled_text
    with pytest.raises(ModelReferenceError) as error:
        sampling.Sampler(dataclasses.replace(described, pooled_text=False))
    assert "one text encoder" in str(error.value) and "two text encoders" in str(error.value)
    assert "\n" not in str(error.value)


def test_a_size_off_fluxs_packing_and_the_heun_sampler_are_refused_in_one_line(tiny_flux_kit, tmp_path, capsys):
    """Review of 16ede1b, defects 2 and 3: FluxPipeline packs 2x2 latent pixels, so at 72 px (a multiple of the
    8x autoencoder's 8, not of 16) it drew 64x64 images without a word, and it always sets sigmas of its own, which
    the flow-matching Heun scheduler refuses (diffusers' ValueError traceback). Each is one line now, before any
    image is drawn; SD3's and SANA's pipelines still sample with heun (tests/sample/test_mmdit_sampling.py)."""
    from diffusion import cli
    out = tmp_path / "x.png"
    for flags, why in ((["--size", "72"], "image size 72x72 (height x width): each side must be a multiple of 16 px "
                                          "for this model (8x autoencoder, 2x2 patches), e.g. 64x64"),
                       (["--scheduler", "heun"], "--scheduler heun: the FluxTransformer2DModel's pipeline sets the "
                                                 "sampler's sigmas itself, and FlowMatchHeunDiscreteScheduler takes "
                                                 "none: it samples with euler")):
        with pytest.raises(SystemExit):
            cli.run(generate.main, "generate", ["--checkpoint", tiny_flux_kit, "--prompt", "a red circle",
                                                "--steps", "1", "--out", str(out), *flags])
        assert capsys.readouterr().err == f"generate: error: {why}\n"
    assert not out.exists()
