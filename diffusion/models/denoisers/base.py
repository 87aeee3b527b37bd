"""What every denoiser adapter provides: see :class:`DenoiserAdapter`."""

from __future__ import annotations

import contextlib
import functools
import json
import os

import torch

from diffusion.models import loading


class DenoiserAdapter:
    """One diffusers denoiser class as the model uses it.

    ``component`` is its folder in a model reference (``unet``, ``transformer``); ``blocks`` the class
    names of the modules FSDP wraps, activation checkpointing recomputes and compile may compile one by
    one (by name, so the wrapping survives diffusers moving classes between modules).
    """

    class_name: str
    component: str
    blocks: frozenset = frozenset()
    channels_last: bool = False  # a convolutional network that gains from channels_last
    masking: bool = False  # deferred patch masking (model.masking): transformers over patches
    pooled_text: bool = False  # reads a pooled text vector (``pooled=``): a second text encoder's, where there is one

    @property
    def model_class(self):
        import diffusers
        return getattr(diffusers, self.class_name)

    # ---- building ------------------------------------------------------------------------------------
    def load_config(self, model_ref: str) -> dict:
        with open(os.path.join(loading.component_path(model_ref, self.component), "config.json")) as f:
            return json.load(f)

    def build(self, config: dict, seed: int = 0) -> torch.nn.Module:
        """The denoiser of ``config`` with random init from ``seed`` (the global RNG is left as it was:
        the same seed gives the same initial weights on every rank and every run)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.mark_blocks(self.model_class.from_config(config))

    def from_pretrained(self, pretrained: str) -> torch.nn.Module:
        """Weights from a component directory, or from a model reference's component."""
        path = pretrained
        if not os.path.isfile(os.path.join(path, "config.json")):
            path = loading.component_path(pretrained, self.component)
        loading.check_weight_files(path)
        return self.mark_blocks(self.model_class.from_pretrained(path))

    def mark_blocks(self, module: torch.nn.Module) -> torch.nn.Module:
        """Composer's FSDP and activation checkpointing ask the root's children for these."""
        module.fsdp_wrap_fn = functools.partial(_is_block, self.blocks)
        module.activation_checkpointing_fn = functools.partial(_is_block, self.blocks)
        return module

    def latent_channels(self, config: dict) -> int:
        """The channels of the latents the denoiser reads (its ``in_channels``, unless it packs patches)."""
        return int(config["in_channels"])

    def text_dim(self, config: dict) -> int:
        """The width of the text states the denoiser attends to."""
        raise NotImplementedError

    def pooled_dim(self, config: dict) -> int | None:
        """The width of the pooled text vector the denoiser reads (None: it reads none)."""
        return None

    def enable_text_mask(self, module) -> None:
        """Make ``module`` read the ``text_mask`` its calls pass (nothing to do where diffusers' own forward
        takes one)."""

    # ---- the call ------------------------------------------------------------------------------------
    def __call__(self, module, noisy: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor, keep=None,
                 mixer_blocks: int = 0, route=None, route_span=None, text_mask=None) -> torch.Tensor:
        """The prediction for ``noisy`` latents at ``timesteps`` given the text states ``text`` (with
        ``text_mask``, (B, L) bool, attending to the True tokens only: the caption, not its padding); with
        ``keep`` (adapters with :attr:`masking`) only the kept patches pass the blocks after the first
        ``mixer_blocks``, and the prediction is zero on the others; with ``route`` only the listed patches
        pass the blocks of ``route_span``, the others skip them (token routing)."""
        raise NotImplementedError

    def patch_size(self, config: dict) -> int:
        raise ValueError(f"{self.class_name} has no patches to mask")

    def loss_mask(self, module, keep, shape) -> torch.Tensor:
        """(B, 1, H, W): 1 where the masked step predicts (the kept patches)."""
        raise ValueError(f"{self.class_name} has no patches to mask")

    def forward_flops(self, config: dict, latent_size, text_dim: int, text_length: int,
                      mask_ratio: float = 0.0, mixer_blocks: int = 0, route_ratio: float = 0.0,
                      route_span: tuple[int, int] | None = None) -> int:
        """FLOPs of one image's forward, counted by torch on the meta device (no memory, no compute); with
        ``mask_ratio`` the masked forward's, with ``route_ratio`` the routed one's over ``route_span``, as a
        training step runs them. ``latent_size``: a side, or (height, width) for an aspect-ratio bucket."""
        return _forward_flops(self, json.dumps(config, sort_keys=True, default=str), latent_size, text_dim,
                              text_length, float(mask_ratio), int(mixer_blocks), float(route_ratio),
                              tuple(route_span) if route_span else None)

    def route_span(self, module, span: tuple[int, int]) -> tuple[int, int]:
        """``model.routing``'s (start, end) as block indices of ``module``, checked."""
        raise ValueError(f"{self.class_name} has no tokens to route")

    # ---- sampling ------------------------------------------------------------------------------------
    def sample_size(self, module) -> int:
        """Latent side length the denoiser's config was built for."""
        return int(module.config.sample_size)

    def pipeline(self, module, *, vae, text_encoder, tokenizer, scheduler):
        """A diffusers pipeline around ``module`` and the frozen parts."""
        raise NotImplementedError

    # The autoencoder classes :meth:`pipeline`'s diffusers class holds, and whether it adds the shift factor
    # back when it decodes (SD's pipelines divide by the scaling factor only).
    pipeline_autoencoders: tuple = ("AutoencoderKL",)
    pipeline_shift: bool = False
    # The pipeline's text-encoder slots left empty (our one encoder and tokenizer are saved beside them in
    # text_encoder/ and tokenizer/): an export loads with ``from_pretrained(DIR, **dict.fromkeys(empty_slots))``.
    empty_slots: tuple = ()
    cfg_argument: str = "guidance_scale"  # the pipeline call's classifier-free guidance scale
    # Latent pixels a side the pipeline packs into one token (Flux's 2x2), beyond the config's patch_size: a size
    # off that grid the pipeline would round down without a word.
    packing: int = 1
    # The pipeline always sets its scheduler's timesteps from sigmas of its own (FluxPipeline): a scheduler
    # whose set_timesteps takes none cannot sample it.
    passes_sigmas: bool = False

    def pipeline_decodes(self, space) -> bool:
        """Whether the diffusers pipeline decodes latents of ``space`` (a :class:`~diffusion.schema.LatentSpace`)
        itself, so an exported pipeline draws what we draw."""
        return space.autoencoder in self.pipeline_autoencoders and (self.pipeline_shift or not space.shift_factor)

    def unpack(self, pipe, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """(B, C, h, w) latents from what the pipeline returns with ``output_type="latent"`` (a pipeline
        of packed patches returns them packed)."""
        return latents

    def call_kwargs(self, guidance_scale: float, module=None) -> dict:
        """The pipeline call's arguments beyond the prompts, size, steps and generators: the guidance (and what
        ``module``, the denoiser being sampled, was trained with that the pipeline would otherwise default)."""
        return {self.cfg_argument: guidance_scale}

    def prompt_kwargs(self, pipe, prompts: list[str], negative_prompt: str | None, guidance_rescale: float,
                      length: int | None = None, masked: bool = False) -> dict:
        """The pipeline call's prompt arguments (text, or the embeddings our conditioning makes), prompts
        padded to ``length`` tokens; with ``masked`` also ``text_masks``: (negative, positive) (B, L) masks
        for :meth:`text_mask_hook`, which the caller pops before calling the pipeline."""
        raise NotImplementedError

    def mask_kwargs(self, mask: torch.Tensor, dtype) -> dict:
        """The denoiser call's keyword arguments that carry a (B, L) bool text mask."""
        raise NotImplementedError

    @contextlib.contextmanager
    def text_mask_hook(self, module, masks):
        """While sampling, each denoiser call gets the prompts' text mask (``masks`` = (negative, positive)
        from :meth:`prompt_kwargs`; None: nothing): the pipelines do not pass one themselves. A call on
        the doubled batch of classifier-free guidance gets them concatenated in the pipelines' order,
        negative first."""
        if masks is None:
            yield
            return
        negative, positive = masks

        def inject(_, args, kwargs):
            states = kwargs["encoder_hidden_states"]
            mask = positive if states.shape[0] == positive.shape[0] else torch.cat([negative, positive])
            return args, {**kwargs, **self.mask_kwargs(mask.to(states.device), states.dtype)}

        handle = module.register_forward_pre_hook(inject, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


def _is_block(blocks, module: torch.nn.Module) -> bool:
    return type(module).__name__ in blocks


@functools.lru_cache(maxsize=16)
def _forward_flops(adapter: DenoiserAdapter, config_json: str, latent_size: int, text_dim: int,
                   text_length: int, mask_ratio: float = 0.0, mixer_blocks: int = 0, route_ratio: float = 0.0,
                   route_span: tuple[int, int] | None = None) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    config = json.loads(config_json)
    model_class = adapter.model_class  # diffusers imported outside the meta device (its import runs torch ops)
    height, width = (latent_size, latent_size) if isinstance(latent_size, int) else latent_size
    with torch.device("meta"):
        module = model_class.from_config(config)
        sample = torch.empty(1, adapter.latent_channels(config), height, width)
        text = torch.empty(1, text_length, text_dim)
        timestep = torch.zeros(1)
        pooled_dim = adapter.pooled_dim(config) if adapter.pooled_text else None
        pooled = {"pooled": torch.empty(1, pooled_dim)} if pooled_dim else {}  # a second encoder's, as trained
    from diffusion.models.masking import PatchMask
    keep, routing = None, {}
    if mask_ratio:
        mask = PatchMask(mask_ratio, adapter.patch_size(config))
        keep = torch.zeros(1, mask.kept((config["in_channels"], height, width)), dtype=torch.long)
    if route_ratio:
        route = PatchMask(route_ratio, adapter.patch_size(config))
        routing = {"route": torch.zeros(1, route.kept((config["in_channels"], height, width)), dtype=torch.long),
                   "route_span": route_span}
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        adapter(module, sample, timestep, text, keep=keep, mixer_blocks=mixer_blocks, **routing, **pooled)
    return counter.get_total_flops()
