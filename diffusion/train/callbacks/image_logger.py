"""ImageLogger: a grid from fixed prompts and a fixed seed, at every eval (or an interval), EMA weights.

Logged through Composer's ``logger.log_images`` (wandb, and any other image-capable logger) under the
key ``samples_ema`` or ``samples_raw`` (which weights drew it) and, optionally, saved as
``{save_folder}/samples_ema_{batch:08d}.png``. Sampling uses the same path as ``diffusion.generate``
(:class:`diffusion.models.sampling.Sampler`) with the model's training noise schedule (zero terminal SNR
included), at the model's training resolution (``StableDiffusion.resolution``, not the UNet config's
sample size), so the pictures seen during training are what the exported model will draw.

Only rank 0 samples, logs and saves, except under FSDP: there every forward all-gathers the UNet's
shards, a collective every rank must join, so every rank samples and only rank 0 logs and saves.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import create_interval_scheduler, dist

from diffusion.sample import grid
from diffusion.train.algorithms.ema import EMA, _uses_fsdp1
from diffusion.models import sampling


class ImageLogger(Callback):
    """Sample ``prompts`` from the model being trained and log the grid.

    Args:
        prompts: the fixed prompts, one grid row each.
        model_ref: where the VAE, text encoder and tokenizer come from (default: the model's
            description, which also gives the scaling factor, the objective and its schedule, so
            decoding matches training). ``scaling_factor`` and ``prediction_type`` override it.
        interval: a Composer time string ("500ba", "1ep"); None logs at the end of every eval.
        images_per_prompt, steps, guidance_scale, guidance_rescale, scheduler, negative_prompt, seed:
            sampling (``scheduler`` None: the objective's default; ``guidance_rescale`` None: 0.7 for a
            zero-terminal-SNR model, else 0).
        size: pixels per side (default: the model's ``resolution``, the training resolution).
        use_ema: sample with the EMA weights when the EMA algorithm is in the trainer (and has started;
            the key says ``raw`` otherwise, and ``ema`` whenever the EMA is in the model, as during eval).
        save_folder: also write each grid there as PNG (rank 0 only).
        name: the key's stem; the key is ``{name}_ema`` or ``{name}_raw``.
    """

    key = "image_logger"  # its key under callbacks: in the YAML, and in its refusals

    def __init__(self, prompts, *, model_ref: str | None = None, scaling_factor: float | None = None,
                 prediction_type: str | None = None, interval: str | None = None, images_per_prompt: int = 1,
                 steps: int = 25, guidance_scale: float = 7.5, guidance_rescale: float | None = None,
                 scheduler: str | None = None,
                 negative_prompt: str | None = None, seed: int = 0, size: int | None = None,
                 use_ema: bool = True, save_folder: str | None = None, name: str = "samples"):
        if not prompts:
            raise ValueError("ImageLogger needs at least one prompt")
        if scheduler is not None and scheduler not in sampling.SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {', '.join(sampling.SCHEDULERS)}")
        self.prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.model_ref, self.scaling_factor, self.prediction_type = model_ref, scaling_factor, prediction_type
        self.sample_kwargs = dict(steps=steps, guidance_scale=guidance_scale, guidance_rescale=guidance_rescale,
                                  negative_prompt=negative_prompt, seed=seed, size=size,
                                  images_per_prompt=images_per_prompt)
        self.scheduler, self.use_ema, self.save_folder, self.name = scheduler, use_ema, save_folder, name
        self._due = create_interval_scheduler(interval, checkpoint_events=False) if interval else None
        self._sampler = None  # loaded on first use: the VAE and text encoder stay resident after that
        self.saved: list[str] = []
        self._eval_logged_at: int | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        """The VAE and text encoders the grid needs have weights, checked before the first batch: a model reference
        with configs only (the sd2-base kit) would otherwise stop the run at its first eval, hours in, and an
        autoresumed run there again. Only where a grid will be drawn: a run with an eval set or an interval, on the
        ranks that sample (every rank under FSDP, rank 0 otherwise)."""
        if self._due is None and not state.evaluators:
            return  # no eval and no interval: this run draws no grid
        description = getattr(_unwrap(state.model), "description", None)
        if self.scheduler and description is not None:  # a sampler the model's pipeline cannot drive: on every rank
            sampling.sampling_scheduler(description, self.scheduler, f"callbacks.{self.key}.scheduler")
        if dist.get_global_rank() != 0 and not _sharded(state.model):
            return
        ref = self._model_ref(_unwrap(state.model))
        if ref:
            from diffusion.errors import ModelReferenceError
            from diffusion.models import loading
            try:
                loading.require_weights(ref, ("vae", *loading.text_components(ref)))
            except ModelReferenceError as e:
                raise ModelReferenceError(f"callbacks.{self.key}: {e} (or drop the callback: "
                                          f"callbacks.{self.key}=null)") from None

    def eval_end(self, state: State, logger: Logger) -> None:
        # EVAL_END comes once per evaluator (raw and EMA evaluators): one grid per eval is enough.
        batch = int(state.timestamp.batch)
        if self._due is None and batch != self._eval_logged_at:
            self._eval_logged_at = batch
            self.log_grid(state, logger)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._due is not None and self._due(state, Event.BATCH_END):
            _drop_fsdp1_gradients(state)
            self.log_grid(state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self._due is not None and self._due(state, Event.EPOCH_END):
            _drop_fsdp1_gradients(state)
            self.log_grid(state, logger)

    def log_grid(self, state: State, logger: Logger):
        """Sample, log and (optionally) save the grid now; returns it on rank 0, None on other ranks."""
        rank0 = dist.get_global_rank() == 0
        # Without FSDP the other ranks skip sampling: it touches only this rank's copy of the weights
        # (the UNet is called directly, not through DDP's forward) and no collective, so they just
        # wait for rank 0 at the next gradient all-reduce. Under FSDP each UNet forward all-gathers
        # the shards, so every rank must run the same forwards or rank 0 would hang.
        if not rank0 and not _sharded(state.model):
            return None
        model = _unwrap(state.model)
        denoiser = getattr(model, "denoiser", model)
        kwargs = dict(self.sample_kwargs)
        if kwargs["size"] is None:
            kwargs["size"] = getattr(model, "resolution", None)  # None: the UNet config's size
        ema_context, ema_in_model = self._ema_weights(state)
        with ema_context:
            weights = "ema" if ema_in_model() else "raw"
            images = self._get_sampler(model, _compute_dtype(state))(denoiser, self.prompts, **kwargs)
        if not rank0:
            return None
        labels = [p for p in self.prompts for _ in range(self.sample_kwargs["images_per_prompt"])]
        picture = grid.make_grid(images, labels, columns=self.sample_kwargs["images_per_prompt"])
        batch = int(state.timestamp.batch)
        key = f"{self.name}_{weights}"
        logger.log_images(np.asarray(picture), name=key, channels_last=True, step=batch)
        if self.save_folder:
            path = os.path.join(self.save_folder.format(run_name=state.run_name), f"{key}_{batch:08d}.png")
            self.saved.append(grid.save_grid(picture, path))
        return picture

    def _model_ref(self, model) -> str | None:
        """Where the grid's VAE and text encoders come from: the given ``model_ref``, else the model's."""
        return self.model_ref or getattr(getattr(model, "description", None), "model_ref", None) \
            or getattr(model, "model_ref", None)

    def _get_sampler(self, model, dtype=None) -> sampling.Sampler:
        if self._sampler is None:
            description = getattr(model, "description", None)
            if description is not None and not (self.model_ref or self.scaling_factor or self.prediction_type):
                self._sampler = sampling.Sampler(description, scheduler=self.scheduler, dtype=dtype)
                return self._sampler
            model_ref = self._model_ref(model)
            if not model_ref:
                raise ValueError("ImageLogger: pass model_ref= (the model has no model_ref attribute)")
            self._sampler = sampling.Sampler(
                model_ref, scheduler=self.scheduler,
                scaling_factor=self.scaling_factor or getattr(model, "scaling_factor", None),
                prediction_type=self.prediction_type or getattr(model, "prediction_type", None),
                noise_schedule=getattr(model, "noise_schedule", None), dtype=dtype)
        return self._sampler

    def _ema_weights(self, state: State):
        """``(context, ema_in_model)``: the context that swaps the EMA in (when asked for), and a test,
        valid inside it, of whether the model holds the EMA weights."""
        for algorithm in state.algorithms:
            if isinstance(algorithm, EMA):
                if self.use_ema:
                    # inside, the model holds the EMA whenever one exists (swapped here, or for eval)
                    return algorithm.ema_weights(state.model), lambda: algorithm.started
                # Not swapped here; but during eval the EMA algorithm has swapped it in itself.
                return contextlib.nullcontext(), lambda: getattr(algorithm, "_swapped", None) is not None
        return contextlib.nullcontext(), lambda: False


def _drop_fsdp1_gradients(state) -> None:
    """Under FSDP1 the step's gradients are let go before a grid drawn between steps (at an eval they are gone
    already: :class:`diffusion.train.trainer.DropGradientsBeforeEval`). FSDP1 keeps each flat parameter's sharded
    gradient beside the gathered weight, and a compiled block, compiled again for the grid's guided batch,
    refuses such a tensor (``attempting to assign a gradient of size ...``). The optimizer has stepped and the
    next batch sets them to None anyway; a callback after this one that reads them at the same batch end (an
    optimizer monitor) finds none at the batches a grid is drawn."""
    if _uses_fsdp1(state.model):
        for optimizer in state.optimizers:
            optimizer.zero_grad(set_to_none=True)


def _sharded(model) -> bool:
    """Whether FSDP (FSDP1 or FSDP2) wraps any part of ``model``: then forwards are collectives."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = FullyShardedDataParallel
    return any(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in model.modules())


def _unwrap(model):
    # DistributedDataParallel keeps the ComposerModel in .module; FSDP forwards attribute access itself.
    while hasattr(model, "module") and not hasattr(model, "denoiser"):
        model = model.module
    return model


def _compute_dtype(state):
    """The run's compute dtype for the frozen text encoders: bf16 under (amp_)bf16; None (the denoiser's dtype)
    otherwise: fp16 is left out, T5 overflows in it."""
    precision = getattr(state, "precision", None)
    return torch.bfloat16 if str(getattr(precision, "value", precision)) in ("amp_bf16", "bf16") else None
