"""What every objective provides: see :class:`Objective`."""

from __future__ import annotations

import torch


class Objective(torch.nn.Module):
    """One training objective. The model (:class:`~diffusion.models.latent_diffusion.LatentDiffusion`)
    hands it, per sample, the scaled clean latent, the noise, the noise the input is formed with (the
    noise itself, or with input perturbation the perturbed noise) and the uniform draw ``u`` in [0, 1)
    the loader made from (seed, epoch, key); the objective turns ``u`` into a noise level, forms the
    denoiser's input and target, and weights the loss. It holds no random state: every random number
    comes with the batch.

    A module, so its tables (schedules as buffers) follow the model to its device; its buffers are not
    persistent: checkpoints carry :meth:`settings`, not tensors.
    """

    name: str
    # The ``model.*`` keys only this objective (and others that list them) reads: a run whose objective does
    # not list a key that another objective lists is refused when that key is set (see ``check_keys``)
    reads: tuple[str, ...] = ()

    # ---- training --------------------------------------------------------------------------------------
    def level_draw(self):
        """A picklable ``f(generator) -> tensor of shape (1,)``: the per-sample number the loader draws
        for the noise level, from the sample's own generator; None: a uniform number in [0, 1)."""
        return None

    def levels(self, u: torch.Tensor) -> torch.Tensor:
        """The per-sample noise level (a timestep index, a σ ...) for the loader's draws ``u``."""
        raise NotImplementedError

    def noisy_and_target(self, latents, noise, input_noise, levels):
        """``(noisy input, target, the denoiser's timestep)`` for clean ``latents`` at ``levels``."""
        raise NotImplementedError

    def weights(self, levels: torch.Tensor) -> torch.Tensor | None:
        """Per-sample loss weights at ``levels``, or None for uniform."""
        return None

    # ---- evaluation ------------------------------------------------------------------------------------
    def eval_level(self, generator: torch.Generator) -> torch.Tensor:
        """One held-out sample's pinned level, drawn from its own generator (after its latent and noise)."""
        raise NotImplementedError

    def equidistant_levels(self, bins: int) -> torch.Tensor:
        """MLPerf's eval levels: noise ``k / bins`` of the way from clean to pure noise, k = 0 ... bins - 1
        (``model.eval_protocol: mlperf``), low noise first."""
        raise NotImplementedError

    def bin_levels(self, bins: int) -> torch.Tensor:
        """``bins`` fixed levels spread over the range trained on, low noise first (binned eval loss)."""
        raise NotImplementedError

    # ---- description and sampling ----------------------------------------------------------------------
    def settings(self) -> dict:
        """What a checkpoint records to rebuild this objective for sampling (JSON-able)."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, name: str, model_cfg, model_ref: str) -> "Objective":
        raise NotImplementedError

    @classmethod
    def from_params(cls, name: str, params: dict) -> "Objective":
        raise NotImplementedError

    samplers: tuple[str, ...] = ()  # the sampler names diffusion.generate --scheduler takes for it

    def sampling_scheduler(self, model_ref: str, name: str | None = None):
        """A diffusers scheduler that samples what this objective trained (``name``: one of
        :attr:`samplers`; None: the first)."""
        raise NotImplementedError

    def check_sampler(self, name: str | None) -> str:
        name = name or self.samplers[0]
        if name not in self.samplers:
            from diffusion.errors import UserError  # a ValueError: the user's choice, one line
            raise UserError(f"--scheduler {name}: a model trained with the {self.name} objective samples with "
                             f"{', '.join(self.samplers)}")
        return name
