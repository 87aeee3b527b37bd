"""A trained MMDiT with flow matching samples, exports and loads as diffusers' StableDiffusion3Pipeline,
which draws what our sampler draws."""

import os

import numpy as np
import pytest
import torch

from diffusion.sample import export, generate
from diffusion.models import sampling
from sampling_helpers import PROMPTS, pixels as _pixels, train_tiny_checkpoint


@pytest.fixture(scope="module")
def flow_checkpoint(tiny_mmdit_kit, tmp_path_factory):
    return train_tiny_checkpoint(tiny_mmdit_kit, str(tmp_path_factory.mktemp("mmdit_ckpt")),
                                 "model.objective=flow", "model.prediction_type=null", "model.flow.shift=2.0")


@pytest.fixture(scope="module")
def flow_export(flow_checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mmdit_export") / "pipe")
    export.main(["--checkpoint", flow_checkpoint, "--out", out])
    return out


def test_checkpoint_describes_an_mmdit_trained_with_flow(flow_checkpoint):
    trained = sampling.load_trained(flow_checkpoint)
    assert type(trained.denoiser).__name__ == "SD3Transformer2DModel" and trained.ema_used
    assert trained.description.objective == "flow" and trained.description.objective_params["shift"] == 2.0
    sampler = sampling.Sampler(trained.description)
    assert type(sampler.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert sampler.scheduler.config.shift == 2.0
    with pytest.raises(ValueError, match="samples with euler, heun"):
        sampling.Sampler(trained.description, scheduler="ddim")


@pytest.mark.parametrize("scheduler", ["euler", "heun"])
def test_flow_models_sample_with_both_flow_solvers(flow_checkpoint, scheduler):
    kwargs = dict(steps=3, guidance_scale=3.0, scheduler=scheduler)
    a = generate.generate_images(flow_checkpoint, PROMPTS, seed=1, **kwargs)
    b = generate.generate_images(flow_checkpoint, PROMPTS, seed=1, batch_size=1, **kwargs)
    c = generate.generate_images(flow_checkpoint, PROMPTS, seed=2, **kwargs)
    assert a[0].size == (64, 64) and _pixels(a[0]).std() > 1
    assert all(np.abs(_pixels(x) - _pixels(y)).max() <= 2 for x, y in zip(a, b))
    assert np.abs(_pixels(a[0]) - _pixels(c[0])).mean() > 1


def test_export_loads_as_sd3_pipeline_and_draws_what_generate_draws(flow_checkpoint, flow_export):
    from diffusers import DiffusionPipeline, StableDiffusion3Pipeline
    from diffusion.models import loading
    from diffusion.models.denoisers.sd3_transformer import EMPTY_SLOTS, encode_prompts
    pipe = DiffusionPipeline.from_pretrained(flow_export, **dict.fromkeys(EMPTY_SLOTS))
    assert isinstance(pipe, StableDiffusion3Pipeline)
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and pipe.scheduler.config.shift == 2.0
    ours = generate.generate_images(flow_checkpoint, PROMPTS[:1], steps=4, guidance_scale=4.0, seed=11)[0]
    text_encoder, tokenizer = loading.load_text_encoder(flow_export), loading.load_tokenizer(flow_export)
    embeds, pooled = encode_prompts(text_encoder, tokenizer, PROMPTS[:1])
    empty, empty_pooled = encode_prompts(text_encoder, tokenizer, [""])
    theirs = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=empty,
                  negative_pooled_prompt_embeds=empty_pooled, num_inference_steps=4, guidance_scale=4.0,
                  height=64, width=64, generator=[torch.Generator("cpu").manual_seed(11)]).images[0]
    assert np.abs(_pixels(theirs) - _pixels(ours)).max() <= 1
    # the exported directory sampled by our own generate draws the same
    again = generate.generate_images(flow_export, PROMPTS[:1], steps=4, guidance_scale=4.0, seed=11, size=64)[0]
    assert np.abs(_pixels(again) - _pixels(ours)).max() <= 1
    assert os.path.isdir(os.path.join(flow_export, "transformer"))


def test_generate_draws_a_bucket_shape_with_width_and_height(flow_checkpoint, tmp_path):
    from diffusion.sample import generate as gen
    from diffusion.sample.grid import read_grid
    out = tmp_path / "wide.png"
    gen.main(["--checkpoint", flow_checkpoint, "--prompt", "a red circle", "--width", "80", "--height", "48",
              "--steps", "2", "--out", str(out)])
    images, _ = read_grid(str(out))
    assert images[0].size == (80, 48)
    with pytest.raises(Exception, match="--width and --height together"):
        gen.main(["--checkpoint", flow_checkpoint, "--prompt", "x", "--width", "80", "--out", str(out)])
