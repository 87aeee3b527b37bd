"""diffusion.export: a diffusers pipeline directory that StableDiffusionPipeline.from_pretrained runs."""

import json
import os

import numpy as np
import pytest
import torch

from diffusion import export
from diffusion.models import sampling
from sampling_helpers import PROMPTS, kit_unet as _kit_unet, pixels as _pixels


def _load(directory):
    from diffusers import StableDiffusionPipeline
    return StableDiffusionPipeline.from_pretrained(directory)


def test_exported_pipeline_loads_and_draws_what_our_sampler_draws(tiny_kit, tmp_path):
    out = tmp_path / "pipe"
    export.main(["--checkpoint", tiny_kit, "--out", str(out), "--scheduler", "ddim"])
    assert {"unet", "vae", "text_encoder", "tokenizer", "scheduler", "model_index.json"} <= set(os.listdir(out))
    pipe = _load(str(out))
    assert pipe.safety_checker is None
    image = pipe([PROMPTS[0]], num_inference_steps=3, generator=[torch.Generator("cpu").manual_seed(4)]).images[0]
    ours = sampling.sample_images(_kit_unet(tiny_kit), tiny_kit, PROMPTS[:1], scheduler="ddim", steps=3, seed=4)[0]
    assert image.size == ours.size
    assert np.abs(_pixels(image) - _pixels(ours)).max() <= 1


def test_default_keeps_the_reference_scheduler_class(tiny_kit, tmp_path):
    export.export_pipeline(tiny_kit, str(tmp_path / "pipe"))
    with open(tmp_path / "pipe" / "model_index.json") as f:
        exported = json.load(f)["scheduler"][1]
    with open(os.path.join(tiny_kit, "scheduler", "scheduler_config.json")) as f:
        assert exported == json.load(f)["_class_name"]


def test_checkpoint_export_has_ema_unet_and_training_settings(fake_checkpoint, tiny_kit, tmp_path):
    out = str(tmp_path / "pipe")
    export.export_pipeline(fake_checkpoint, out, dtype="float16")
    pipe = _load(out)
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.vae.config.scaling_factor == 0.5
    from safetensors import safe_open
    with safe_open(os.path.join(out, "unet", "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())
    kit = _kit_unet(tiny_kit).state_dict()
    for name, tensor in pipe.unet.state_dict().items():
        torch.testing.assert_close(tensor.float(), kit[name].half().float())


def test_refuses_to_overwrite_its_source(tiny_kit):
    with pytest.raises(ValueError, match="where the model comes from"):
        export.export_pipeline(tiny_kit, tiny_kit)
