"""The ComposerModel: a diffusers denoiser trained with an objective on latents drawn from stored VAE moments.

A model is a **denoiser** (:mod:`diffusion.models.denoisers`: the UNet, an MMDiT ...) and an
**objective** (:mod:`diffusion.models.objectives`: ε / v on the DDPM schedule, rectified flow ...).
One training step, per sample: latent = (z - shift_factor) · scaling_factor with z = mean + σ·ε_z drawn from
the stored moments, or z the stored latent of a deterministic autoencoder (the ONLY place latents are
scaled: :attr:`LatentDiffusion.latent_space`, what dataset.json records), noise ε (+ optional offset, + optional input perturbation), a noise level from the loader's
draw u, then the objective's noisy input and target, loss = (weighted) MSE(denoiser(x, level, text), target).
The random numbers come with the batch, drawn per sample from (seed, epoch, key) by the loader
(:class:`diffusion.loader.batches.NoiseDraws`): the step is the same whatever the microbatch size or
the number of ranks, and the forward has no generator or host sync for ``torch.compile`` to break on.
Eval uses the same path with noise and levels pinned per held-out sample, so evals are comparable;
with ``eval_bins`` it reports the held-out loss at fixed noise levels (``loss_bin{k}``): by default
MLPerf's protocol, each sample at one level (sample i at level i mod bins, σ = k/bins), one denoiser
call a sample; ``eval_protocol="all_levels"`` scores every sample at every bin instead.
The conditioning is the batch's text embeddings, or, from a dataset of token ids, the frozen text
encoder's output on the batch's ids (:mod:`diffusion.models.text_encoder`), computed in the step; with
``text_mask`` the denoiser attends only to each caption's tokens (the batch's token counts), not its padding.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
import torch.nn.functional as F
from composer.models import ComposerModel

from diffusion import schema
from diffusion.errors import ConfigError
from diffusion.models import denoisers, loading, objectives, repa as repa_module
from diffusion.models.description import ModelDescription
from diffusion.models.held_out_loss import HeldOutLoss
from diffusion.models.text_encoder import FrozenTextEncoder, attention_mask

# model.eval_protocol with eval_bins: MLPerf's (each held-out sample at one level, round-robin) or every
# sample at every bin (bins + 1 denoiser calls a sample: lower variance on a small held-out set)
EVAL_PROTOCOLS = ("mlperf", "all_levels")

LEGACY_PREFIX, PREFIX = "unet.", "denoiser."  # checkpoints before the model wing named the UNet "unet"


class LatentDiffusion(ComposerModel):
    """``forward`` noises a batch of moments; ``loss`` is the (weighted) MSE to the objective's target."""

    def __init__(self, denoiser: torch.nn.Module, objective: objectives.Objective, *,
                 scaling_factor: float | None = None, model_ref: str, resolution: int, downsample: int = 8,
                 latent_space: schema.LatentSpace | None = None, offset_noise: float = 0.0,
                 input_perturbation: float = 0.0, eval_seed: int = 0, eval_bins: int = 0,
                 eval_protocol: str = "mlperf",
                 mask_ratio: float = 0.0, mixer_blocks: int = 0, text_encoder: FrozenTextEncoder | None = None,
                 route_ratio: float = 0.0, route_span: tuple[int, int] = (1, -1),
                 text_length: int = schema.MAX_TOKENS, text_mask: bool = False, repa=None, pooled_text: bool = False,
                 text_encoder_type: str | None = None):
        super().__init__()
        self.denoiser = denoiser
        self.adapter = denoisers.adapter_for(denoiser)
        self.objective = objective
        self.text_encoder = text_encoder  # not a submodule: see diffusion.models.text_encoder
        self.model_ref = model_ref
        # The latent space the data is in (dataset.json's): given whole, or SD's with a scaling factor.
        if latent_space is None:
            if scaling_factor is None:
                raise ValueError("give the latent space (or SD's VAE scaling factor)")
            latent_space = schema.LatentSpace(scaling_factor=float(scaling_factor), downsample=int(downsample))
        self.latent_space = latent_space
        self.scaling_factor = float(latent_space.scaling_factor)
        self.resolution = int(resolution)
        self.latent_size = self.resolution // latent_space.downsample
        self.text_dim = self.adapter.text_dim(dict(denoiser.config))
        self.text_length = int(text_length)
        # Attention over the caption's tokens only (T5's long padded captions): the batch's token counts
        # reach the denoiser as a mask (the UNet's encoder_attention_mask, the MMDiT's joint attention).
        self.text_mask = bool(text_mask)
        # The denoiser's pooled vector is the batch's pooled_text_embeds (Flux's CLIP beside T5's sequence), not
        # the mean of the text states (adapters with pooled_text only)
        self.pooled_text = bool(pooled_text)
        self.text_encoder_type = text_encoder_type  # whose embeddings it learns from (dataset.json's), for sampling's check
        if self.text_mask:
            self.adapter.enable_text_mask(denoiser)
        self.offset_noise = offset_noise
        self.input_perturbation = input_perturbation
        self.eval_seed = eval_seed
        self.eval_bins = int(eval_bins)
        if eval_protocol not in EVAL_PROTOCOLS:
            raise ConfigError(f"model.eval_protocol={eval_protocol!r}: one of {', '.join(EVAL_PROTOCOLS)}")
        self.eval_protocol = eval_protocol
        self.mask_ratio, self.mixer_blocks = float(mask_ratio), int(mixer_blocks)
        if self.mask_ratio and not self.adapter.masking:
            raise ConfigError(f"model.masking.ratio={mask_ratio}: {self.adapter.class_name} has no patches to mask; "
                              f"masking needs a transformer denoiser (e.g. SD3Transformer2DModel)")
        self.route_ratio, self.route_span = float(route_ratio), None
        if self.route_ratio:
            if not self.adapter.masking:
                raise ConfigError(f"model.routing.ratio={route_ratio}: {self.adapter.class_name} has no tokens to "
                                  f"route; routing needs a transformer denoiser (e.g. SD3Transformer2DModel)")
            try:
                self.route_span = self.adapter.route_span(denoiser, route_span)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self._register_load_state_dict_pre_hook(_upgrade_state_dict)
        # representation alignment (model.repa, :mod:`diffusion.models.repa`): its projector is a child
        self.repa = repa
        repa_module.state_dict_hooks(self)
        self.loaded_extra_state: dict | None = None
        # Which phase of a staged recipe this run is: 0 from scratch, one more than the run whose weights
        # it starts from (recorded in checkpoints; the per-sample draws are salted with it).
        self.phase = 0
        # A compiled denoiser (trainer.compile under FSDP) compiles a graph set per batch shape: the eval set's
        # last, partial batch is padded to the eval's full batch (its rows repeated, their outputs dropped), so it
        # runs the full batch's graphs instead of compiling its own (:meth:`_eval_rows`)
        self.pad_eval_batches = False
        self._full_eval_rows: dict[tuple, int] = {}
        self.run_identity: dict | None = None  # set by the trainer (diffusion.train.resume)

    @property
    def description(self) -> ModelDescription:
        return ModelDescription(model_ref=self.model_ref, denoiser=self.adapter.class_name,
                                denoiser_config=dict(self.denoiser.config), objective=self.objective.name,
                                objective_params=self.objective.settings(), scaling_factor=self.scaling_factor,
                                resolution=self.resolution, text_dim=self.text_dim, text_length=self.text_length,
                                text_mask=self.text_mask, latent_space=self.latent_space.to_dict(),
                                pooled_text=self.pooled_text,
                                embedded_guidance=getattr(self.denoiser, "embedded_guidance", None),
                                text_encoder_type=self.text_encoder_type)

    # ---- the one place latents are scaled ------------------------------------------------------------
    def sample_latents(self, moments: torch.Tensor, generator=None, eps: torch.Tensor | None = None) -> torch.Tensor:
        """The denoiser's latent from the stored column: drawn from posterior moments (with ``eps`` as the
        standard normal draw when given), or a deterministic autoencoder's latent as stored; then shifted
        and scaled, ``(z - shift_factor) * scaling_factor``."""
        # Square at the model's resolution, or an aspect-ratio bucket's H/f x W/f at about its pixel count.
        space = self.latent_space
        channels, height, width = moments.shape[1:]
        if channels != space.stored_channels or not 0.5 <= height * width / self.latent_size ** 2 <= 2.0:
            raise ValueError(f"{space.stored} of shape {tuple(moments.shape[1:])} do not fit a {self.resolution}px "
                             f"model in {space.describe()} (expected "
                             f"{(space.stored_channels, self.latent_size, self.latent_size)}, or a bucket of about "
                             f"that many pixels)")
        if space.stored == schema.LATENTS:
            z = moments.float()
        else:
            mean, logvar = moments.float().chunk(2, dim=1)
            std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
            if eps is None:
                eps = _randn(mean.shape, generator, mean.device)
            z = mean + std * eps
        if space.shift_factor:
            z = z - space.shift_factor
        return z * self.scaling_factor

    def stored(self, batch: dict) -> torch.Tensor:
        """The batch's stored latent column (moments or latents, as this model's latent space holds)."""
        key = self.latent_space.batch_key
        if key not in batch:
            other = schema.BATCH_LATENTS if key == schema.BATCH_MOMENTS else schema.BATCH_MOMENTS
            held = f"holds {other}" if other in batch else f"holds neither {key} nor {other}"
            raise ValueError(f"the batch {held}, but this model trains in {self.latent_space.describe()}: "
                             f"its data must come from the same autoencoder")
        return batch[key]

    # ---- training ------------------------------------------------------------------------------------
    def forward(self, batch: dict) -> dict:
        moments = self.stored(batch)
        eps = (self._draw(batch, schema.BATCH_POSTERIOR_NOISE, moments)
               if self.latent_space.stored == schema.MOMENTS else None)
        latents = self.sample_latents(moments, eps=eps)
        noise = self._draw(batch, schema.BATCH_NOISE, moments)
        if self.offset_noise:
            noise = noise + self.offset_noise * self._draw(batch, schema.BATCH_OFFSET_NOISE, moments)[..., None, None]
        levels = self.objective.levels(self._draw(batch, schema.BATCH_TIMESTEP_DRAW, moments))
        perturbed = noise
        if self.input_perturbation and self.training:
            perturbed = noise + self.input_perturbation * self._draw(batch, schema.BATCH_PERTURBATION_NOISE, moments)
        keep = batch.get(schema.BATCH_PATCH_KEEP) if self.training and self.mask_ratio else None
        route = batch.get(schema.BATCH_ROUTE_KEEP) if self.training and self.route_ratio else None
        return self._denoise(latents, noise, perturbed, levels, *self.conditioning(batch), keep=keep, route=route,
                             pooled=self.pooled_of(batch))

    def pooled_of(self, batch: dict) -> torch.Tensor | None:
        """The batch's pooled text vectors (B, P), for a model conditioned on them (:attr:`pooled_text`); else None."""
        if not self.pooled_text:
            return None
        if schema.BATCH_POOLED_TEXT_EMBEDS not in batch:
            raise ValueError(f"this model reads the second text encoder's pooled vector, and the batch holds no "
                             f"{schema.BATCH_POOLED_TEXT_EMBEDS}: its data must come from the same two text encoders")
        return batch[schema.BATCH_POOLED_TEXT_EMBEDS]

    def conditioning(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's text embeddings (stored ones, or the frozen text encoder's output on its token ids)
        and, with ``text_mask``, their attention mask (B, L) bool from the batch's token counts."""
        counts = batch.get(schema.BATCH_TEXT_TOKENS)
        if schema.BATCH_TEXT_EMBEDS in batch:
            embeds = batch[schema.BATCH_TEXT_EMBEDS]
        elif self.text_encoder is None:
            raise ValueError("the batch holds token ids but no text embeddings, and this model has no text encoder "
                             "to encode them (model.text=ids builds one)")
        else:
            embeds = self.text_encoder(batch[schema.BATCH_INPUT_IDS], counts)
        if not self.text_mask:
            return embeds, None
        if counts is None:
            raise ValueError(f"model.text_mask needs the captions' token counts ({schema.BATCH_TEXT_TOKENS}) in the batch")
        return embeds, attention_mask(counts.to(embeds.device), embeds.shape[1])

    def _draw(self, batch: dict, name: str, moments: torch.Tensor) -> torch.Tensor:
        """The batch's per-sample draw ``name``; a batch built by hand without them gets fresh ones."""
        if name in batch:
            return batch[name].to(device=moments.device, dtype=torch.float32)
        n, latent_channels = moments.shape[0], self.latent_space.channels
        if name == schema.BATCH_TIMESTEP_DRAW:
            return torch.rand(n, device=moments.device)
        if name == schema.BATCH_OFFSET_NOISE:
            return torch.randn(n, latent_channels, device=moments.device)
        return torch.randn(n, latent_channels, *moments.shape[2:], device=moments.device)

    def _denoise(self, latents, noise, input_noise, levels, text_embeds, text_mask=None, keep=None, route=None,
                 pooled=None) -> dict:
        noisy, target, timesteps = self.objective.noisy_and_target(latents, noise, input_noise, levels)
        routing = {"route": route, "route_span": self.route_span} if route is not None else {}
        masked = {"text_mask": text_mask} if text_mask is not None else {}
        if pooled is not None:
            masked["pooled"] = pooled
        aligned = {}  # REPA: the aligned block's image tokens, while it is on (training only)
        align = self.repa is not None and self.repa.active and self.training
        if align:
            self.repa.capture(aligned)
        prediction = self.adapter(self.denoiser, noisy, timesteps, text_embeds, keep=keep,
                                  mixer_blocks=self.mixer_blocks, **routing, **masked)
        if align:
            self.repa.capture(None)
        outputs = {"prediction": prediction, "target": target, "levels": levels, "noise": noise, "latents": latents}
        if align:
            outputs["repa"] = self.repa(aligned["tokens"], latents, keep if keep is not None else route)
        if keep is not None:  # the loss is taken over the kept patches only
            outputs["loss_mask"] = self.adapter.loss_mask(self.denoiser, keep.to(latents.device), latents.shape)
        return outputs

    def loss(self, outputs: dict, batch: dict) -> torch.Tensor:
        per_sample = _per_sample_mse(outputs)
        weight = self.objective.weights(outputs["levels"])
        if weight is not None:
            per_sample = per_sample * weight
        if "repa" in outputs:  # + λ · the alignment's negative cosine similarity
            return per_sample.mean() + self.repa.weight * outputs["repa"].mean()
        return per_sample.mean()

    # ---- evaluation: pinned noise and levels per held-out sample -------------------------------------
    def eval_forward(self, batch: dict, outputs=None) -> dict:
        if outputs is not None:
            return outputs
        moments = self.stored(batch)
        indices = given = batch.get(schema.BATCH_SAMPLE_INDEX)
        if indices is None:  # a source without indices: pin by position in the batch
            indices = torch.arange(moments.shape[0])
        latents, noise, levels = [], [], []
        for i, index in enumerate(indices.tolist()):
            g = torch.Generator().manual_seed(self.eval_seed * 1_000_003 + int(index))
            latents.append(self.sample_latents(moments[i:i + 1], generator=g))
            noise.append(_randn(latents[-1].shape, g, moments.device))
            levels.append(self.objective.eval_level(g))
        latents, noise = torch.cat(latents), torch.cat(noise)
        levels = torch.cat(levels).to(moments.device)
        text, pooled = self.conditioning(batch), self.pooled_of(batch)
        round_robin = self.eval_bins and self.eval_protocol == "mlperf"
        if round_robin:  # MLPerf: sample i at level i mod bins (σ = k/bins), its only denoiser call
            bin_of = indices.to("cpu", torch.long) % self.eval_bins
            levels = self.objective.equidistant_levels(self.eval_bins)[bin_of].to(moments.device)
        n, rows = len(latents), self._eval_rows(latents)
        if rows > n:
            latents, noise, levels, pooled = (_repeat_rows(x, rows) for x in (latents, noise, levels, pooled))
            text = tuple(_repeat_rows(x, rows) for x in text)
        with torch.no_grad():
            outputs = _first_rows(self._denoise(latents, noise, noise, levels, *text, pooled=pooled), n)
            if round_robin:
                outputs["bin_of"], outputs["per_sample"] = bin_of.to(moments.device), _per_sample_mse(outputs)
            elif self.eval_bins:  # all_levels: every held-out sample at each bin's level, same latent and noise
                outputs["bins"] = [_per_sample_mse(_first_rows(self._denoise(
                    latents, noise, noise, level.expand(len(latents)), *text, pooled=pooled), n))
                                   for level in self.objective.bin_levels(self.eval_bins).to(moments.device)]
        outputs["sample_index"] = given  # the metrics count each held-out sample once (HeldOutLoss)
        return outputs

    def _eval_rows(self, latents: torch.Tensor) -> int:
        """How many rows the eval's denoiser call takes for these latents: their own number, or, with
        :attr:`pad_eval_batches`, the most an eval batch of their shape has had (the loader's batch size from
        the set's first batch on: streaming hands each rank its eval samples in full batches, and only the
        last may be partial)."""
        n = len(latents)
        if not self.pad_eval_batches:
            return n
        shape = tuple(latents.shape[1:])  # a bucketed set: each latent shape its own batches
        self._full_eval_rows[shape] = max(self._full_eval_rows.get(shape, 0), n)
        return self._full_eval_rows[shape]

    def get_metrics(self, is_train: bool = False) -> dict:
        if is_train:
            return {}
        metrics = {"loss": HeldOutLoss()}
        for k in range(self.eval_bins):  # tagged: Composer hands update_metric the metric, not its name
            metrics[f"loss_bin{k}"] = HeldOutLoss()
            metrics[f"loss_bin{k}"].level_bin = k
        return metrics

    def update_metric(self, batch, outputs, metric) -> None:
        k = getattr(metric, "level_bin", None)
        index = outputs.get("sample_index")
        if k is not None and "bin_of" in outputs:  # MLPerf's protocol: the samples given level k (maybe none)
            chosen = outputs["bin_of"] == k
            metric.update(outputs["per_sample"][chosen], None if index is None else index.to(chosen.device)[chosen])
            return
        metric.update(_per_sample_mse(outputs) if k is None else outputs["bins"][k], index)

    # ---- throughput ------------------------------------------------------------------------------------
    def flops_per_batch(self, batch: dict) -> float:
        """Denoiser training FLOPs of ``batch``: forward + backward ≈ 3 × forward (for SpeedMonitor's MFU)."""
        masked = self.mask_ratio if schema.BATCH_PATCH_KEEP in batch else 0.0  # what the step really computes
        routed = {"route_ratio": self.route_ratio, "route_span": self.route_span} if (
            self.route_ratio and schema.BATCH_ROUTE_KEEP in batch) else {}
        moments = self.stored(batch)
        per_image = self.adapter.forward_flops(dict(self.denoiser.config), tuple(moments.shape[2:]), self.text_dim,
                                               self.text_length, mask_ratio=masked, mixer_blocks=self.mixer_blocks,
                                               **routed)
        if self.repa is not None and self.repa.active:
            tokens = (moments.shape[2] // self.repa.patch) * (moments.shape[3] // self.repa.patch)
            per_image = 3.0 * per_image + self.repa.flops_per_image(
                (self.latent_space.channels, *moments.shape[2:]), tokens)
            return per_image * moments.shape[0]
        return 3.0 * per_image * moments.shape[0]

    # ---- self-description in checkpoints ---------------------------------------------------------------
    def get_extra_state(self) -> dict:
        """The model description (:class:`~diffusion.models.description.ModelDescription`): what sampling
        and export need to rebuild this model, the objective's schedule included; and the run's phase."""
        state = {"description": self.description.to_dict(), "phase": self.phase}
        if self.run_identity:  # the run's data and text encoder: autoresume continues only its own run
            state["run"] = dict(self.run_identity)
        return state

    def set_extra_state(self, state: dict) -> None:
        """Keep this model's settings (phase 2 loads phase-1 weights at a new resolution); check they fit."""
        self.loaded_extra_state = dict(state)
        try:
            loaded = ModelDescription.from_extra_state(state)
        except KeyError:
            return
        mine = self.description
        if loaded.text_dim not in (None, mine.text_dim):
            raise ValueError(f"checkpoint was trained with text_dim {loaded.text_dim}, this model has {mine.text_dim}")
        # A later phase (weights of an earlier one) must train the same network with the same objective:
        # only the resolution, the masking and the schedule of training may change between phases.
        if loaded.denoiser != mine.denoiser:
            raise ConfigError(f"the checkpoint holds a {loaded.denoiser}, this run trains a {mine.denoiser}")
        differs = sorted(k for k in set(loaded.denoiser_config) | set(mine.denoiser_config)
                         if not k.startswith("_") and k != "sample_size"
                         and loaded.denoiser_config.get(k) != mine.denoiser_config.get(k))
        if differs:
            k = differs[0]
            raise ConfigError(f"the checkpoint's {loaded.denoiser} has {k}={loaded.denoiser_config.get(k)!r}, this "
                              f"run's {mine.denoiser_config.get(k)!r} ({len(differs)} setting(s) differ): the phase "
                              f"must continue the same network")
        # the scaling factor may change between phases (warned below); the space itself may not
        was, now = (schema.LatentSpace.from_dict(d) for d in (loaded.latent_space, mine.latent_space))
        if loaded.latent_space is not None and dataclasses.replace(was, scaling_factor=now.scaling_factor) != now:
            was, now = was.describe(), now.describe()
            raise ConfigError(f"the checkpoint was trained in {was}, this run's data is in {now}: a phase continues "
                              f"in its predecessor's latent space")
        if loaded.objective != mine.objective:
            raise ConfigError(f"the checkpoint was trained with the {loaded.objective} objective, this run trains "
                              f"{mine.objective}: a phase continues its predecessor's objective")
        for key in ("scaling_factor", "embedded_guidance"):
            if getattr(loaded, key) not in (None, getattr(mine, key)):
                warnings.warn(f"checkpoint {key}={getattr(loaded, key)!r} differs from this run's {getattr(mine, key)!r}")
        if loaded.noise_schedule not in (None, mine.noise_schedule):
            warnings.warn(f"checkpoint noise_schedule={loaded.noise_schedule!r} differs from this run's "
                          f"{mine.noise_schedule!r}")


def _upgrade_state_dict(state_dict, prefix, *args) -> None:
    """Checkpoints written before the model wing: the UNet under ``unet.``, and a noise step counter."""
    state_dict.pop(prefix + "noise_step", None)
    for key in [k for k in state_dict if k.startswith(prefix + LEGACY_PREFIX)]:
        state_dict[prefix + PREFIX + key[len(prefix + LEGACY_PREFIX):]] = state_dict.pop(key)


def _randn(shape, generator, device) -> torch.Tensor:
    if generator is None:
        return torch.randn(shape, device=device)
    # a CPU generator (eval) gives the same numbers on any device
    return torch.randn(shape, generator=generator, device=generator.device).to(device)


def _repeat_rows(x: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``x`` with its rows repeated in turn up to ``rows`` rows (None stays None)."""
    if x is None:
        return None
    return x[torch.arange(rows, device=x.device) % len(x)]


def _first_rows(outputs: dict, n: int) -> dict:
    """The per-sample outputs of a padded batch, cut back to its ``n`` real rows."""
    return {k: v[:n] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in outputs.items()}


def _per_sample_mse(outputs: dict) -> torch.Tensor:
    squared = F.mse_loss(outputs["prediction"].float(), outputs["target"].float(), reduction="none")
    mask = outputs.get("loss_mask")
    if mask is None:
        return squared.mean(dim=(1, 2, 3))
    return (squared * mask).sum(dim=(1, 2, 3)) / (mask.sum(dim=(1, 2, 3)) * squared.shape[1])


# ---- building ---------------------------------------------------------------------------------------

def objective_name(model_cfg, model_ref: str) -> str:
    """``model.objective``, else ``model.prediction_type``, else the model reference scheduler's."""
    if model_cfg.objective:
        return model_cfg.objective
    if model_cfg.prediction_type:
        return model_cfg.prediction_type
    return loading.load_scheduler(model_ref, "ddpm").config.prediction_type


def build_denoiser(model_cfg, model_ref: str, seed: int = 0) -> torch.nn.Module:
    """The denoiser of ``model_ref``'s config with random init from ``seed``, or ``model.pretrained``'s weights."""
    adapter = denoisers.adapter(denoisers.resolve_class(model_ref, model_cfg.denoiser))
    if model_cfg.pretrained:
        return adapter.from_pretrained(model_cfg.pretrained)
    return adapter.build(adapter.load_config(model_ref), seed=seed)


def set_embedded_guidance(denoiser: torch.nn.Module, value: float | None) -> None:
    """``model.embedded_guidance``: the value a guidance-distilled denoiser (``guidance_embeds``: Flux.1-dev)
    reads while training (null: 1.0), kept on the module for its adapter; a one-line refusal for a denoiser
    without a guidance embedding, which would ignore it."""
    if dict(denoiser.config).get("guidance_embeds"):
        denoiser.embedded_guidance = 1.0 if value is None else float(value)
    elif value is not None:
        raise ConfigError(f"model.embedded_guidance={value}: the {type(denoiser).__name__} has no guidance embedding "
                          f"(its config's guidance_embeds is not true), so it would ignore it; remove the key")


def check_latent_channels(denoiser: torch.nn.Module, info: schema.DatasetInfo, where: str) -> None:
    """The denoiser reads and predicts latents of the data's width, or a one-line refusal naming the key."""
    adapter = denoisers.adapter_for(denoiser)
    config = dict(denoiser.config)
    channels = adapter.latent_channels(config)
    if channels != info.latent_space.channels:
        raise ConfigError(
            f"{where}: its {adapter.class_name} has in_channels={config.get('in_channels')} ({channels}-channel "
            f"latents), but dataset.json records {info.latent_space.describe()}: give a denoiser for "
            f"{info.latent_space.channels} channels, or convert the data with the denoiser's autoencoder")


# Denoisers whose reference trains its T5 sequence unmasked: SD3 (its pipeline and training scripts pass the
# MMDiT's joint attention no mask) and Flux (FluxPipeline and its training scripts: none either, one text
# encoder or two). Unmasked, attention can take SDPA's flash kernel, which takes no mask of any form (a float
# additive mask goes to the same memory-efficient kernel a boolean one does): issue 47, item 14.
UNMASKED_T5_REFERENCES = frozenset({"SD3Transformer2DModel", "FluxTransformer2DModel"})


def text_mask_of(model_cfg, info: schema.DatasetInfo, denoiser_class: str | None = None) -> bool:
    """``model.text_mask``, else (null) on for a text encoder that reads masks itself (T5), off for CLIP (SD2
    trains on the padded embeddings, as its pipeline samples), for Flux's two text encoders (FluxPipeline
    passes the transformer no mask) and for a T5 under SD3's MMDiT or Flux (both train T5 unmasked:
    :data:`UNMASKED_T5_REFERENCES`; ``model.text_mask: true`` masks it). SANA's and PixArt's references
    mask their long captions; the UNet keeps the mask too."""
    if model_cfg.text_mask is not None:
        return bool(model_cfg.text_mask)
    if info.pooled_text_dim is not None or denoiser_class in UNMASKED_T5_REFERENCES:
        return False
    return loading.text_encoder_takes_mask(info.text_encoder_type or loading.CLIP_TEXT)


def reads_two_text_encoders(model_cfg, ref: str, adapter=None) -> bool:
    """Whether the denoiser (``adapter``; None: the one ``model.denoiser`` resolves to) reads the pooled vector of
    ``ref``'s second text encoder (Flux's layout); ``model.text=ids`` is then refused in one line: the step would
    encode one encoder's ids only."""
    adapter = adapter or denoisers.adapter(denoisers.resolve_class(ref, model_cfg.denoiser))
    if not adapter.pooled_text or loading.pooled_text_slots(ref) is None:
        return False
    if model_cfg.text == "ids":
        raise ConfigError(f"model.text=ids: model.ref {ref} has two text encoders (Flux's layout: T5's sequence and "
                          f"CLIP's pooled vector), and the step encodes one text encoder's ids only: set "
                          f"model.text=embeds (the converter stores both encoders' outputs)")
    return True


def pooled_text_of(model_cfg, ref: str, denoiser: torch.nn.Module, info: schema.DatasetInfo) -> bool:
    """Whether the denoiser's pooled vector is the data's ``pooled_text_embeds``: a denoiser that reads one (Flux)
    of a model reference with two text encoders (Flux's layout), on data converted with them; refused in one
    line where the data or ``model.text`` cannot give it."""
    adapter = denoisers.adapter_for(denoiser)
    if not reads_two_text_encoders(model_cfg, ref, adapter):
        return False
    two = f"model.ref {ref} has two text encoders (Flux's layout: T5's sequence and CLIP's pooled vector)"
    if info.pooled_text_dim is None:
        raise ConfigError(f"{two}, but the data stores no {schema.POOLED_TEXT_EMBEDS} (dataset.json has no "
                          f"pooled_text_dim: converted with one text encoder, or before the kit had two): convert "
                          f"it again with --model {ref}")
    width = adapter.pooled_dim(dict(denoiser.config))
    if width != info.pooled_text_dim:
        raise ConfigError(f"model.ref {ref}: its {adapter.class_name} has pooled_projection_dim={width}, but the "
                          f"data's pooled vectors are {info.pooled_text_dim} wide: give the model reference the "
                          f"data was converted with")
    return True


def build_model(model_cfg, info: schema.DatasetInfo, seed: int = 0,
                text_encoder: FrozenTextEncoder | None = None) -> LatentDiffusion:
    """The ComposerModel for ``model_cfg`` (a :class:`diffusion.train.config.ModelConfig`) on data ``info``;
    ``text_encoder`` when it trains from token ids."""
    ref = model_cfg.ref
    if os.path.isdir(os.path.expanduser(ref)):  # checkpoints record a path that works from any directory
        ref = os.path.abspath(os.path.expanduser(ref))
    name = objective_name(model_cfg, ref)
    if model_cfg.zero_terminal_snr and name != "v_prediction":
        raise ConfigError(f"model.zero_terminal_snr needs v-prediction, and this run trains {name} "
                          f"(epsilon is undefined at the terminal step): set model.prediction_type=v_prediction")
    objective = objectives.build_objective(name, model_cfg, ref)
    denoiser = build_denoiser(model_cfg, ref, seed=seed)
    check_latent_channels(denoiser, info, f"model.pretrained {model_cfg.pretrained}" if model_cfg.pretrained
                          else f"model.ref {ref}")
    set_embedded_guidance(denoiser, getattr(model_cfg, "embedded_guidance", None))
    repa = repa_module.build(model_cfg, denoiser, denoisers.adapter_for(denoiser), info, seed=seed)
    pooled_text = pooled_text_of(model_cfg, ref, denoiser, info)
    return LatentDiffusion(
        denoiser, objective, model_ref=ref, resolution=model_cfg.resolution,
        latent_space=info.latent_space, offset_noise=model_cfg.offset_noise,
        input_perturbation=model_cfg.input_perturbation, eval_seed=model_cfg.eval_seed,
        eval_bins=model_cfg.eval_bins, eval_protocol=model_cfg.eval_protocol, mask_ratio=model_cfg.masking.ratio,
        mixer_blocks=model_cfg.masking.mixer_blocks, text_encoder=text_encoder, route_ratio=model_cfg.routing.ratio,
        route_span=(model_cfg.routing.start, model_cfg.routing.end), text_length=info.text_length,
        text_mask=text_mask_of(model_cfg, info, type(denoiser).__name__), repa=repa, pooled_text=pooled_text,
        text_encoder_type=info.text_encoder_type)
