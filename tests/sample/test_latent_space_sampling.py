"""Sampling decodes in the latent space the checkpoint records: a 16-channel VAE's shift is added back (and the
exported SD3 pipeline draws what we draw), DC-AE latents decode at /32, and an export diffusers would
decode otherwise, or a model reference of another autoencoder, is refused in one line."""

import numpy as np
import pytest
import torch

from diffusion.errors import ModelReferenceError, UserError
from diffusion.models import loading, sampling
from diffusion.sample import export, generate
from sampling_helpers import PROMPTS, pixels, train_tiny_checkpoint

FLOW = ("model.objective=flow", "model.prediction_type=null")


def _checkpoint(kit, folder):
    space = loading.latent_space_of(loading.load_vae_config(kit))
    return train_tiny_checkpoint(kit, str(folder), *FLOW, batches=2, latent_space=space), space


@pytest.fixture(scope="module")
def vae16_checkpoint(tiny_vae16_kit, tmp_path_factory):
    return _checkpoint(tiny_vae16_kit, tmp_path_factory.mktemp("vae16_ckpt"))


@pytest.fixture(scope="module")
def dcae_checkpoint(tiny_dcae_kit, tmp_path_factory):
    return _checkpoint(tiny_dcae_kit, tmp_path_factory.mktemp("dcae_ckpt"))


def test_a_16_channel_model_decodes_with_its_shift_and_exports_as_sd3(vae16_checkpoint, tmp_path):
    from diffusers import DiffusionPipeline
    from diffusion.models.denoisers.sd3_transformer import EMPTY_SLOTS, encode_prompts
    checkpoint, space = vae16_checkpoint
    trained = sampling.load_trained(checkpoint)
    assert trained.description.latent_space == space.to_dict() and space.shift_factor == pytest.approx(0.1)
    sampler = sampling.Sampler(trained.description)
    latents = torch.randn(1, 16, 8, 8)
    want = sampler.vae.decode(latents / space.scaling_factor + space.shift_factor).sample
    torch.testing.assert_close(sampler.decode(latents), want)

    ours = generate.generate_images(checkpoint, PROMPTS[:1], steps=3, guidance_scale=3.0, seed=5)[0]
    assert ours.size == (64, 64)
    out = str(tmp_path / "pipe")
    export.main(["--checkpoint", checkpoint, "--out", out])
    pipe = DiffusionPipeline.from_pretrained(out, **dict.fromkeys(EMPTY_SLOTS))
    assert pipe.vae.config.shift_factor == pytest.approx(0.1) and pipe.vae.config.latent_channels == 16
    text_encoder, tokenizer = loading.load_text_encoder(out), loading.load_tokenizer(out)
    embeds, pooled = encode_prompts(text_encoder, tokenizer, PROMPTS[:1])
    empty, empty_pooled = encode_prompts(text_encoder, tokenizer, [""])
    theirs = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=empty,
                  negative_pooled_prompt_embeds=empty_pooled, num_inference_steps=3, guidance_scale=3.0,
                  height=64, width=64, generator=[torch.Generator("cpu").manual_seed(5)]).images[0]
    assert np.abs(pixels(theirs) - pixels(ours)).max() <= 1


def test_a_dcae_model_samples_at_its_downsampling_and_refuses_an_sd3_export(dcae_checkpoint, tmp_path):
    checkpoint, space = dcae_checkpoint
    images = generate.generate_images(checkpoint, PROMPTS, steps=2, guidance_scale=3.0, seed=1)
    assert [im.size for im in images] == [(64, 64)] * 2  # 2x2 latents, /32
    with pytest.raises(UserError) as error:
        export.export_pipeline(checkpoint, str(tmp_path / "pipe"))
    assert "\n" not in str(error.value) and "AutoencoderDC" in str(error.value)
    assert not (tmp_path / "pipe").exists()


def test_sampling_with_another_autoencoders_reference_is_refused(vae16_checkpoint, tiny_mmdit_kit):
    checkpoint, _ = vae16_checkpoint
    with pytest.raises(ModelReferenceError) as error:
        generate.generate_images(checkpoint, PROMPTS[:1], steps=1, model_ref=tiny_mmdit_kit)
    assert "\n" not in str(error.value) and "16 channels" in str(error.value) and "4 channels" in str(error.value)
