"""A trained MMDiT with flow matching samples, exports and loads as diffusers' StableDiffusion3Pipeline,
which draws what our sampler draws."""

import contextlib
import io
import os

import numpy as np
import pytest

from diffusion.sample import export, generate
from diffusion.models import sampling
from sampling_helpers import PROMPTS, pixels as _pixels, run_printed_call, train_tiny_checkpoint


@pytest.fixture(scope="module")
def flow_checkpoint(tiny_mmdit_kit, tmp_path_factory):
    return train_tiny_checkpoint(tiny_mmdit_kit, str(tmp_path_factory.mktemp("mmdit_ckpt")),
                                 "model.objective=flow", "model.prediction_type=null", "model.flow.shift=2.0",
                                 text_encoder_type="clip_text_model")  # as the converter records the kit's CLIP


@pytest.fixture(scope="module")
def flow_export(flow_checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mmdit_export") / "pipe")
    with contextlib.redirect_stdout(io.StringIO()) as said:  # what the export tells the user to run
        export.main(["--checkpoint", flow_checkpoint, "--out", out])
    return out, said.getvalue()


def test_checkpoint_describes_an_mmdit_trained_with_flow(flow_checkpoint):
    trained = sampling.load_trained(flow_checkpoint)
    assert type(trained.denoiser).__name__ == "SD3Transformer2DModel" and trained.ema_used
    assert trained.description.objective == "flow" and trained.description.objective_params["shift"] == 2.0
    sampler = sampling.Sampler(trained.description)
    assert type(sampler.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert sampler.scheduler.config.shift == 2.0
    with pytest.raises(ValueError, match="samples with euler, heun"):
        sampling.Sampler(trained.description, scheduler="ddim")


def test_guidance_rescale_on_a_flow_model_is_refused_and_the_protocol_records_what_was_sampled(flow_checkpoint):
    """--guidance-rescale on a flow model was accepted and changed nothing (rc 0, the same pixels); the protocol
    evaluate writes records the EMA and the rescale the sampler used, not the flags as given."""
    from diffusion.errors import UserError
    with pytest.raises(UserError, match="--guidance-rescale 0.7: rescaling applies to DDPM models"):
        generate.generate_images(flow_checkpoint, ["a red circle"], steps=1, guidance_rescale=0.7, size=32)
    protocol = {}
    generate.generate_images(flow_checkpoint, ["a red circle"], steps=1, size=32, protocol=protocol)
    assert protocol["ema"] is True and protocol["guidance_rescale"] == 0.0
    generate.generate_images(flow_checkpoint, ["a red circle"], steps=1, size=32, protocol=protocol, ema=False)
    assert protocol["ema"] is False


def test_a_model_reference_with_another_kind_of_text_encoder_is_refused(flow_checkpoint, tiny_t5_kit):
    """``--model`` naming a T5 kit for a checkpoint trained on CLIP's embeddings sampled with rc 0 and no word."""
    from diffusion.errors import UserError
    assert sampling.load_trained(flow_checkpoint).description.text_encoder_type == "clip_text_model"
    with pytest.raises(UserError, match=rf"^--model {tiny_t5_kit}: its text encoder is a T5EncoderModel, and this "
                                        r"checkpoint was trained on a CLIPTextModel's embeddings: give a model "
                                        r"reference with that text encoder, or leave --model out$"):
        sampling.load_trained(flow_checkpoint, model_ref=tiny_t5_kit)


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
    out, said = flow_export
    from diffusion.models.denoisers.sd3_transformer import EMPTY_SLOTS
    pipe = DiffusionPipeline.from_pretrained(out, **dict.fromkeys(EMPTY_SLOTS))
    assert isinstance(pipe, StableDiffusion3Pipeline)
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and pipe.scheduler.config.shift == 2.0
    # the lines export prints run as written (our text encoder's embeddings, the negative prompt's included:
    # the pipeline has no encoder to make them) and draw what our sampler draws, at the trained size
    assert "height=64, width=64" in said, said
    theirs = run_printed_call(said, seed=5)
    ours = generate.generate_images(flow_checkpoint, ["a prompt"], steps=28, guidance_scale=4.0, seed=5)[0]
    assert theirs.size == (64, 64) and np.abs(_pixels(theirs) - _pixels(ours)).max() <= 1
    # the exported directory sampled by our own generate draws the same
    ours = generate.generate_images(flow_checkpoint, PROMPTS[:1], steps=4, guidance_scale=4.0, seed=11)[0]
    again = generate.generate_images(out, PROMPTS[:1], steps=4, guidance_scale=4.0, seed=11, size=64)[0]
    assert np.abs(_pixels(again) - _pixels(ours)).max() <= 1
    assert os.path.isdir(os.path.join(out, "transformer"))


def test_generate_draws_a_bucket_shape_with_width_and_height(flow_checkpoint, tmp_path, capsys):
    from diffusion.sample import generate as gen
    from diffusion.sample.grid import read_grid
    out = tmp_path / "wide.png"
    gen.main(["--checkpoint", flow_checkpoint, "--prompt", "a red circle", "--width", "80", "--height", "48",
              "--steps", "2", "--out", str(out)])
    images, _ = read_grid(str(out))
    assert images[0].size == (80, 48)
    with pytest.raises(Exception, match="--width and --height together"):
        gen.main(["--checkpoint", flow_checkpoint, "--prompt", "x", "--width", "80", "--out", str(out)])
    # a side that is no whole number of 16-px patches, or beyond the 32-patch positional table: one line,
    # before the latents are embedded (100000 px took 23 GB and the OOM killer; 70 px was diffusers' traceback)
    from diffusion import cli
    capsys.readouterr()
    for width, height, why in ((70, 48, "image size 48x70 (height x width): each side must be a multiple of 16 px "
                                        "for this model (8x autoencoder, 2x2 patches), e.g. 48x64"),
                               (100000, 100000, "image size 100000x100000 (height x width): this model's positional "
                                                "table covers at most 512 px a side (32 patches of 16 px)")):
        with pytest.raises(SystemExit):
            cli.run(gen.main, "generate", ["--checkpoint", flow_checkpoint, "--prompt", "x", "--width", str(width),
                                           "--height", str(height), "--steps", "1", "--out", str(tmp_path / "x.png")])
        assert capsys.readouterr().err == f"generate: error: {why}\n"
    with pytest.raises(SystemExit):  # a DDPM sampler for a flow model: one line, not a ValueError traceback
        cli.run(gen.main, "generate", ["--checkpoint", flow_checkpoint, "--prompt", "x", "--scheduler", "ddim",
                                       "--steps", "1", "--out", str(tmp_path / "x.png")])
    assert capsys.readouterr().err == ("generate: error: --scheduler ddim: a model trained with the flow objective "
                                       "samples with euler, heun\n")
    with pytest.raises(SystemExit):  # nan guidance drew a blank grid with rc 0
        gen.main(["--checkpoint", flow_checkpoint, "--prompt", "x", "--guidance-scale", "nan"])
    assert "argument --guidance-scale: nan is not a finite number" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_masked_export_is_called_as_its_pipeline_can_take_the_masks(tmp_path):
    """SD3's pipeline passes no text mask to its transformer: the export of a masked MMDiT points to our
    sampler rather than print a call that would draw unmasked; SANA's pipeline passes them, so it gets the call."""
    import json
    from diffusion.models import denoisers
    (tmp_path / sampling.TEXT_CONDITIONING).write_text(json.dumps({"text_mask": True, "text_length": 77}))
    sd3 = export.embeddings_call(str(tmp_path), "StableDiffusion3Pipeline", denoisers.adapter("SD3Transformer2DModel"), 64)
    assert "prompt_inputs" not in sd3 and f"python -m diffusion.generate --checkpoint {tmp_path}" in sd3
    sana = export.embeddings_call(str(tmp_path), "SanaPipeline", denoisers.adapter("SanaTransformer2DModel"), 64)
    assert 'image = pipe(**prompt_inputs(pipe, "a prompt"), height=64, width=64' in sana
