"""ImageLogger: fixed-prompt grids during Composer training, with EMA weights when EMA is in the trainer,
at the training resolution, on rank 0 (every rank under FSDP, where forwards are collectives)."""

import contextlib
import os
import types

import numpy as np
import pytest
import torch
from composer import Trainer
from composer.loggers import LoggerDestination
from composer.models import ComposerModel

from diffusion.train.callbacks.image_logger import ImageLogger
from diffusion.sample import grid
from diffusion.train.algorithms import ema
from diffusion.models import sampling

PROMPTS = ["a red circle", "a blue square"]


class TinyDiffusion(ComposerModel):
    """Just enough of a diffusion ComposerModel: a denoiser (a UNet), its model reference, a loss."""

    def __init__(self, kit, resolution=None):
        super().__init__()
        from diffusers import UNet2DConditionModel
        self.denoiser = UNet2DConditionModel.from_pretrained(os.path.join(kit, "unet"))
        self.model_ref = kit
        if resolution:
            self.resolution = resolution

    def forward(self, batch):
        return self.denoiser(batch["latents"], 10, encoder_hidden_states=batch["embeds"]).sample

    def loss(self, outputs, batch):
        return outputs.pow(2).mean()


class Batches(torch.utils.data.Dataset):
    def __init__(self, unet, n=4):
        size, dim = unet.config.sample_size, unet.config.cross_attention_dim
        self.items = [{"latents": torch.randn(4, size, size), "embeds": torch.randn(77, dim)} for _ in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class ImageCapture(LoggerDestination):
    def __init__(self):
        self.images = []

    def log_images(self, images, name="Images", channels_last=False, step=None, *masks_and_options, **kwargs):
        self.images.append((name, step, np.asarray(images)))


class EMA(ema.EMA):
    """The real EMA with a recognisable swap: ``ema_weights(model)`` halves the weights while inside."""

    @property
    def started(self):
        return True

    def match(self, event, state):
        return False

    def apply(self, event, state, logger):
        return None

    @contextlib.contextmanager
    def ema_weights(self, model):
        saved = {k: v.clone() for k, v in model.denoiser.state_dict().items()}
        with torch.no_grad():
            for p in model.denoiser.parameters():
                p.mul_(0.5)
        try:
            yield
        finally:
            model.denoiser.load_state_dict(saved)


def _fit(model, callback, *, algorithms=(), eval_interval=None, duration="2ba"):
    capture = ImageCapture()
    data = torch.utils.data.DataLoader(Batches(model.denoiser), batch_size=2)
    trainer = Trainer(model=model, train_dataloader=data, max_duration=duration, callbacks=[callback],
                      loggers=[capture], algorithms=list(algorithms), device="cpu", progress_bar=False,
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.0),
                      eval_dataloader=data if eval_interval else None, eval_interval=eval_interval or 1,
                      save_folder=None)
    trainer.fit()
    trainer.close()
    return capture.images


def test_interval_logs_the_same_grid_for_unchanged_weights_and_saves_pngs(tiny_kit, tmp_path):
    callback = ImageLogger(PROMPTS, interval="1ba", steps=2, images_per_prompt=2, save_folder=str(tmp_path / "png"))
    logged = _fit(TinyDiffusion(tiny_kit), callback)
    assert [(name, step) for name, step, _ in logged] == [("samples_raw", 1), ("samples_raw", 2)]
    assert np.array_equal(logged[0][2], logged[1][2])  # fixed seed, lr 0: identical pictures
    assert len(callback.saved) == 2 and all(os.path.exists(p) for p in callback.saved)
    assert os.path.basename(callback.saved[0]) == "samples_raw_00000001.png"
    images, prompts = grid.read_grid(callback.saved[0])
    assert prompts == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    assert np.array_equal(np.asarray(grid.make_grid(images, prompts, columns=2)), logged[0][2])


@pytest.mark.slow  # two Composer fits; ~10 s alone, over 30 s on a loaded 2-core machine
def test_uses_ema_weights_when_ema_is_present_and_restores_training_weights(tiny_kit):
    model = TinyDiffusion(tiny_kit)
    before = {k: v.clone() for k, v in model.denoiser.state_dict().items()}
    with_ema = _fit(model, ImageLogger(PROMPTS, interval="1ba", steps=2), algorithms=[EMA()], duration="1ba")
    without = _fit(TinyDiffusion(tiny_kit), ImageLogger(PROMPTS, interval="1ba", steps=2, use_ema=False),
                   algorithms=[EMA()], duration="1ba")
    assert (with_ema[0][0], without[0][0]) == ("samples_ema", "samples_raw")  # the key says which weights
    assert np.abs(with_ema[0][2].astype(int) - without[0][2].astype(int)).mean() > 1
    for k, v in model.denoiser.state_dict().items():
        torch.testing.assert_close(v, before[k])
    # The EMA picture is what the halved weights draw.
    halved = TinyDiffusion(tiny_kit)
    with EMA().ema_weights(halved):
        images = sampling.sample_images(halved.denoiser, tiny_kit, PROMPTS, steps=2)
    assert np.abs(np.asarray(grid.make_grid(images, PROMPTS, columns=1)).astype(int)
                  - with_ema[0][2].astype(int)).max() <= 1


def test_logs_at_eval_by_default(tiny_kit):
    logged = _fit(TinyDiffusion(tiny_kit), ImageLogger(PROMPTS, steps=2), eval_interval="1ba", duration="2ba")
    assert [step for _, step, _ in logged] == [1, 2]


def test_one_grid_per_eval_whatever_the_number_of_evaluators(tiny_kit):
    """EVAL_END comes once per evaluator (training evaluates raw and EMA weights separately)."""
    from composer.core import Evaluator
    model = TinyDiffusion(tiny_kit)
    data = torch.utils.data.DataLoader(Batches(model.denoiser), batch_size=2)
    capture = ImageCapture()
    trainer = Trainer(model=model, train_dataloader=data, max_duration="2ba", loggers=[capture],
                      callbacks=[ImageLogger(PROMPTS, steps=2)], device="cpu", progress_bar=False,
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.0), eval_interval="1ba",
                      eval_dataloader=[Evaluator(label="eval", dataloader=data),
                                       Evaluator(label="eval_ema", dataloader=data)], save_folder=None)
    trainer.fit()
    trainer.close()
    assert [step for _, step, _ in capture.images] == [1, 2]


# ---- log_grid called directly, with just the parts of Composer's State it reads -----------------------

def _state(model, algorithms=()):
    return types.SimpleNamespace(model=model, algorithms=list(algorithms), run_name="run",
                                 timestamp=types.SimpleNamespace(batch=7))


@pytest.fixture(scope="module")
def half_res_model(tiny_kit):
    """The tiny kit's UNet (sample size 8: 64 px with the kit's VAE) trained at 32 px."""
    return TinyDiffusion(tiny_kit, resolution=32)


def test_grid_is_drawn_at_the_training_resolution_not_the_unet_config_size(half_res_model, tiny_kit, tmp_path):
    assert sampling.default_size(half_res_model.denoiser, tiny_kit) == 64
    callback = ImageLogger(PROMPTS, steps=2, save_folder=str(tmp_path))
    capture = ImageCapture()
    callback.log_grid(_state(half_res_model), capture)
    images, _ = grid.read_grid(callback.saved[0])
    assert [im.size for im in images] == [(32, 32)] * len(PROMPTS)
    # an explicit size still wins
    ImageLogger(PROMPTS, steps=2, size=48, save_folder=str(tmp_path / "48")).log_grid(_state(half_res_model), capture)
    assert {im.size for im in grid.read_grid(str(tmp_path / "48" / "samples_raw_00000007.png"))[0]} == {(48, 48)}


def test_key_names_the_weights_that_drew_the_grid(half_res_model, tmp_path):
    capture = ImageCapture()
    ImageLogger(PROMPTS, steps=2).log_grid(_state(half_res_model, [EMA()]), capture)
    ImageLogger(PROMPTS, steps=2, use_ema=False).log_grid(_state(half_res_model, [EMA()]), capture)
    ImageLogger(PROMPTS, steps=2).log_grid(_state(half_res_model), capture)  # no EMA in the trainer
    not_started = ema.EMA()  # the real EMA before its start batch: there is no average yet
    ImageLogger(PROMPTS, steps=2).log_grid(_state(half_res_model, [not_started]), capture)
    assert [name for name, _, _ in capture.images] == ["samples_ema", "samples_raw", "samples_raw", "samples_raw"]
    assert not np.array_equal(capture.images[0][2], capture.images[1][2])


def test_under_bf16_the_text_encoder_stays_in_bf16_and_the_denoiser_in_fp32(half_res_model):
    """The frozen text encoder is kept in the run's compute dtype: in fp32 a T5-XXL is ~19 GB on every rank that
    samples (issue 49 item 5)."""
    capture = ImageCapture()
    bf16 = ImageLogger(PROMPTS[:1], steps=1)
    state = _state(half_res_model)
    state.precision = "amp_bf16"
    bf16.log_grid(state, capture)
    assert bf16._sampler.text_encoder.dtype == torch.bfloat16
    assert next(half_res_model.denoiser.parameters()).dtype == torch.float32
    assert bf16._sampler.vae.dtype == torch.float32  # the decoder stays at the denoiser's precision
    assert capture.images[0][2].astype(float).std() > 0  # a grid was drawn


def test_other_ranks_neither_sample_nor_log_without_fsdp(half_res_model, monkeypatch, tmp_path):
    from diffusion.train.callbacks import image_logger
    monkeypatch.setattr(image_logger.dist, "get_global_rank", lambda: 1)
    callback, capture = ImageLogger(PROMPTS, steps=2, save_folder=str(tmp_path)), ImageCapture()
    assert callback.log_grid(_state(half_res_model), capture) is None
    assert callback._sampler is None  # nothing loaded, nothing sampled
    assert capture.images == [] and os.listdir(tmp_path) == []


def test_under_fsdp_other_ranks_sample_but_only_rank0_logs(half_res_model, monkeypatch, tmp_path):
    """Every FSDP forward all-gathers the shards: a rank that skipped sampling would hang rank 0."""
    from diffusion.train.callbacks import image_logger
    monkeypatch.setattr(image_logger.dist, "get_global_rank", lambda: 1)
    monkeypatch.setattr(image_logger, "_sharded", lambda model: True)
    callback, capture = ImageLogger(PROMPTS, steps=2, save_folder=str(tmp_path)), ImageCapture()
    forwards = []
    half_res_model.denoiser.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        assert callback.log_grid(_state(half_res_model), capture) is None
    finally:
        half_res_model.denoiser._forward_pre_hooks.clear()
    assert len(forwards) == 2  # the same forwards as rank 0: 2 steps, both prompts and guidance in one batch
    assert capture.images == [] and os.listdir(tmp_path) == []


def test_a_zero_terminal_snr_model_is_sampled_with_its_schedule(half_res_model):
    from diffusion.models import loading
    schedule = dict(loading.noise_schedule_of(loading.load_scheduler(half_res_model.model_ref).config),
                    rescale_betas_zero_snr=True)
    half_res_model.noise_schedule = schedule
    try:
        sampler = ImageLogger(PROMPTS, steps=2)._get_sampler(half_res_model)
    finally:
        del half_res_model.noise_schedule
    assert sampler.zero_terminal_snr
    assert sampler.scheduler.config.timestep_spacing == "trailing"
    sampler.scheduler.set_timesteps(2)
    assert sampler.scheduler.timesteps[0] == 999 and sampler.scheduler.alphas_cumprod[999] == 0


def test_bad_settings_fail_at_construction():
    with pytest.raises(ValueError, match="at least one prompt"):
        ImageLogger([])
    with pytest.raises(ValueError, match="unknown scheduler"):
        ImageLogger(PROMPTS, scheduler="plms")


def test_a_model_without_vae_weights_is_refused_before_the_first_batch(tiny_kit, tmp_path):
    """The sd2-base kit (configs only) trained through run.py with the YAML's image logger stopped at the first
    eval, after the batches before it (seen on an H200, session 33); it now stops before the first batch."""
    import shutil
    from diffusion.errors import ModelReferenceError
    kit = tmp_path / "kit"
    shutil.copytree(tiny_kit, kit)
    for f in (kit / "vae").iterdir():
        if f.suffix in (".safetensors", ".bin"):
            f.unlink()
    model = TinyDiffusion(str(kit))
    data = torch.utils.data.DataLoader(Batches(model.denoiser), batch_size=2)

    def trainer(with_eval):
        return Trainer(model=model, train_dataloader=data, max_duration="2ba", callbacks=[ImageLogger(PROMPTS, steps=2)],
                       device="cpu", progress_bar=False, optimizers=torch.optim.SGD(model.parameters(), lr=0.0),
                       eval_dataloader=data if with_eval else None, eval_interval="2ba", save_folder=None)
    refused = trainer(with_eval=True)
    try:
        with pytest.raises(ModelReferenceError, match=r"callbacks\.image_logger: .*vae has a config but no weights"):
            refused.fit()
        assert int(refused.state.timestamp.batch) == 0
    finally:
        refused.close()
    # without an eval set (and no interval) no grid is ever drawn: the run trains as before
    plain = trainer(with_eval=False)
    try:
        plain.fit()
        assert int(plain.state.timestamp.batch) == 2
    finally:
        plain.close()


def test_a_sampler_fluxs_pipeline_cannot_drive_is_refused_before_the_first_batch(tiny_flux_kit, tiny_kit):
    """Review of 16ede1b, defect 3: ``scheduler: heun`` on a Flux model ended the run at its first grid with
    diffusers' ValueError (FluxPipeline sets sigmas of its own, the Heun scheduler takes none); it is refused at fit
    start in one line naming the key, for the judge's grids too. A UNet's sampler is left as it was."""
    from diffusion.errors import UserError
    from diffusion.train.callbacks.judge_metrics import JudgeMetrics
    flux = types.SimpleNamespace(description=sampling.describe_reference(tiny_flux_kit))
    state = types.SimpleNamespace(model=flux, evaluators=[])
    for callback, key in ((ImageLogger(PROMPTS, scheduler="heun", interval="1ba"), "image_logger"),
                          (JudgeMetrics(per_category=1, scheduler="heun", interval="1ba"), "judge_metrics")):
        with pytest.raises(UserError, match=rf"^callbacks\.{key}\.scheduler heun: the FluxTransformer2DModel's "
                                            rf"pipeline sets the sampler's sigmas itself, .* it samples with euler$"):
            callback.fit_start(state, None)
    unet = types.SimpleNamespace(description=sampling.describe_reference(tiny_kit), model_ref=None)
    ImageLogger(PROMPTS, scheduler="dpm++", interval="1ba").fit_start(types.SimpleNamespace(model=unet), None)
