"""Sampling, prompt grids and the generate CLI (diffusion.models.sampling, diffusion.generate)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion.sample import generate
from diffusion.sample import grid
from diffusion.models import loading, sampling
from sampling_helpers import PROMPTS, kit_unet as _kit_unet, pixels as _pixels

@pytest.fixture(scope="module")
def sampler(tiny_kit):
    return sampling.Sampler(tiny_kit)


@pytest.fixture(scope="module")
def unet(tiny_kit):
    return _kit_unet(tiny_kit)


def test_same_seed_same_images_whatever_the_batch_other_seed_differs(sampler, unet):
    a = sampler(unet, PROMPTS, steps=3, seed=1, images_per_prompt=2, batch_size=4)
    b = sampler(unet, PROMPTS, steps=3, seed=1, images_per_prompt=2, batch_size=3)
    c = sampler(unet, PROMPTS, steps=3, seed=2, images_per_prompt=2, batch_size=4)
    assert len(a) == 4 and all(isinstance(im, Image.Image) for im in a)
    for x, y in zip(a, b):
        assert np.abs(_pixels(x) - _pixels(y)).max() <= 2  # float noise across batch shapes only
    assert np.abs(_pixels(a[0]) - _pixels(c[0])).mean() > 5
    # Two images of one prompt start from different noise.
    assert np.abs(_pixels(a[0]) - _pixels(a[1])).mean() > 5


def test_default_size_follows_the_unet_and_vae_and_size_overrides(sampler, unet, tiny_kit):
    expected = unet.config.sample_size * loading.vae_downsample(loading.load_vae_config(tiny_kit))
    assert sampler(unet, PROMPTS[:1], steps=2)[0].size == (expected, expected)
    assert sampler(unet, PROMPTS[:1], steps=2, size=(expected // 2, expected))[0].size == (expected, expected // 2)


@pytest.mark.parametrize("name", sampling.DDPM_SCHEDULERS)
def test_every_scheduler_samples(tiny_kit, unet, name):
    images = sampling.sample_images(unet, tiny_kit, PROMPTS[:1], scheduler=name, steps=3, negative_prompt="blurry")
    assert np.asarray(images[0]).std() > 0


def _ztsnr_schedule(kit):
    return dict(loading.noise_schedule_of(loading.load_scheduler(kit).config), rescale_betas_zero_snr=True)


@pytest.mark.parametrize("name", sampling.DDPM_SCHEDULERS)
def test_a_zero_terminal_snr_schedule_starts_sampling_at_pure_noise(tiny_kit, name):
    """Training's last timestep has ᾱ = 0: the sampler must start there ("trailing" spacing), not at 961."""
    scheduler = sampling.load_sampling_scheduler(tiny_kit, name, "v_prediction", _ztsnr_schedule(tiny_kit))
    assert scheduler.config.rescale_betas_zero_snr and scheduler.config.timestep_spacing == "trailing"
    scheduler.set_timesteps(25)
    assert int(scheduler.timesteps[0]) == 999
    assert float(scheduler.alphas_cumprod[999]) < 1e-6  # DDIM: 0; Euler, DPM++: 2**-24 (finite sigma)


def test_without_a_recorded_schedule_the_reference_scheduler_is_kept(tiny_kit):
    """Checkpoints written before schedules were recorded, and models trained without ZTSNR: as before."""
    old = sampling.load_sampling_scheduler(tiny_kit, "ddim", "v_prediction")
    plain = sampling.load_sampling_scheduler(tiny_kit, "ddim", "v_prediction",
                                             loading.noise_schedule_of(loading.load_scheduler(tiny_kit).config))
    reference = loading.load_scheduler(tiny_kit, "ddim")
    for scheduler in (old, plain):
        assert dict(scheduler.config, prediction_type="epsilon") == dict(reference.config)
        scheduler.set_timesteps(25)
        assert int(scheduler.timesteps[0]) == 961  # "leading" spacing with steps_offset 1, as the kit says


def test_guidance_rescale_defaults_to_0_7_with_zero_terminal_snr_and_0_without(tiny_kit, unet):
    ztsnr = sampling.Sampler(tiny_kit, prediction_type="v_prediction", noise_schedule=_ztsnr_schedule(tiny_kit))
    kwargs = dict(steps=2, seed=3, guidance_scale=7.5)
    default, phi07, off = (ztsnr(unet, PROMPTS[:1], guidance_rescale=g, **kwargs)[0] for g in (None, 0.7, 0.0))
    assert np.array_equal(_pixels(default), _pixels(phi07))
    assert np.abs(_pixels(default) - _pixels(off)).mean() > 1
    plain = sampling.Sampler(tiny_kit)
    assert np.array_equal(_pixels(plain(unet, PROMPTS[:1], **kwargs)[0]),
                          _pixels(plain(unet, PROMPTS[:1], guidance_rescale=0.0, **kwargs)[0]))


def test_cli_guidance_rescale_is_checked_and_its_default_explained(capsys):
    parser = generate.build_parser()
    assert parser.parse_args(["--guidance-rescale", "0.5"]).guidance_rescale == 0.5
    assert parser.parse_args([]).guidance_rescale is None  # the sampler picks 0.7 or 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--guidance-rescale", "1.5"])
    assert "not between 0 and 1" in capsys.readouterr().err
    help_text = " ".join(parser.format_help().split())
    assert "0.7 for a model trained with zero terminal SNR, else 0" in help_text


def test_unknown_scheduler_is_refused(tiny_kit):
    with pytest.raises(ValueError, match="unknown scheduler 'plms'"):
        sampling.load_sampling_scheduler(tiny_kit, "plms")


def test_prediction_type_and_scaling_factor_reach_the_pipeline(tiny_kit, unet):
    sampler = sampling.Sampler(tiny_kit, scheduler="euler", scaling_factor=0.5, prediction_type="v_prediction")
    pipe = sampler.pipeline(unet)
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.vae.config.scaling_factor == 0.5


def test_unconditional_input_is_the_empty_caption_embedding(sampler, unet):
    """Training drops captions to the stored embedding of "" padded to 77 tokens; sampling must match."""
    tokens = sampler.tokenizer("", padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    with torch.no_grad():
        empty = sampler.text_encoder(tokens.input_ids)[0]
        cond = sampler.text_encoder(sampler.tokenizer(PROMPTS[0], padding="max_length", max_length=77,
                                                      truncation=True, return_tensors="pt").input_ids)[0]
    pipe = sampler.pipeline(unet)
    explicit = pipe(prompt_embeds=cond, negative_prompt_embeds=empty, num_inference_steps=3, guidance_scale=5.0,
                    generator=[torch.Generator("cpu").manual_seed(0)], output_type="np").images[0]
    default = sampler(unet, PROMPTS[:1], steps=3, guidance_scale=5.0, seed=0)[0]
    assert np.abs(np.round(explicit * 255) - _pixels(default)).max() <= 1


def test_grid_has_labels_and_round_trips_with_its_prompts(sampler, unet, tmp_path):
    images = sampler(unet, PROMPTS, steps=2)
    picture = grid.make_grid(images, PROMPTS, columns=2)
    tile = images[0].size[0]
    assert picture.width == 2 * tile * max(1, -(-128 // tile))
    label_strip = _pixels(picture)[picture.height - 10:, :, :]
    assert (label_strip < 100).any(), "no label text drawn under the tiles"
    path = grid.save_grid(picture, str(tmp_path / "g.png"))
    back, prompts = grid.read_grid(path)
    assert prompts == PROMPTS
    for a, b in zip(images, back):
        assert np.array_equal(_pixels(a), _pixels(b))


def test_grid_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="one prompt per image"):
        grid.make_grid([Image.new("RGB", (8, 8))], ["a", "b"])
    plain = tmp_path / "plain.png"
    Image.new("RGB", (8, 8)).save(plain)
    with pytest.raises(ValueError, match="not a prompt grid"):
        grid.read_grid(str(plain))


def test_cli_writes_a_labelled_grid_from_a_diffusers_directory(tiny_kit, tmp_path):
    out = tmp_path / "grid.png"
    generate.main(["--checkpoint", tiny_kit, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--steps", "2",
                   "--images-per-prompt", "2", "--scheduler", "dpm++", "--out", str(out)])
    images, prompts = grid.read_grid(str(out))
    assert prompts == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    assert json.loads(Image.open(out).text[grid.GRID_KEY])["columns"] == 2


def test_cli_needs_a_prompt(tiny_kit, tmp_path):
    with pytest.raises(SystemExit):
        generate.main(["--checkpoint", tiny_kit, "--out", str(tmp_path / "g.png")])


def test_checkpoint_uses_ema_weights_by_default(fake_checkpoint, tiny_kit, tmp_path):
    # fake_checkpoint is in the format of before noise schedules were recorded: it still loads, and
    # samples with the model reference's schedule.
    assert sampling.load_trained(fake_checkpoint).noise_schedule is None
    kwargs = dict(steps=3, seed=0, guidance_scale=1.0)
    ema = generate.generate_images(fake_checkpoint, PROMPTS[:1], **kwargs)[0]
    raw = generate.generate_images(fake_checkpoint, PROMPTS[:1], ema=False, **kwargs)[0]
    assert ema.size == (32, 32)  # the training resolution recorded in the checkpoint
    assert np.abs(_pixels(ema) - _pixels(raw)).mean() > 1
    # The EMA UNet is the kit's: same images as sampling the kit with the checkpoint's settings.
    expected = sampling.sample_images(_kit_unet(tiny_kit), tiny_kit, PROMPTS[:1], scaling_factor=0.5,
                                      prediction_type="v_prediction", size=32, **kwargs)[0]
    assert np.abs(_pixels(ema) - _pixels(expected)).max() <= 1


def test_a_directory_that_is_no_pipeline_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="without model_index.json"):
        sampling.load_trained(str(tmp_path))
