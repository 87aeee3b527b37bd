"""Representation alignment (REPA, Yu et al. 2024): a transformer denoiser learns from a frozen vision encoder.

A small MLP (:class:`Projector`) maps the image tokens after one of the denoiser's blocks to the patch
features a frozen vision encoder (DINOv2, DINOv3, SigLIP, the kit's tiny ViT) computes on the clean image,
and the training loss gains ``weight`` × their negative cosine similarity, averaged over each sample's
tokens (``model.repa``). PRX aligns DINOv3's features at block 8 with weight 0.5, and switches it off after
about 200k steps (``until``: :class:`RepaSwitch` sets it from the trainer's batch count, which a resumed
run restores, so the switch-off batch is the same however often a run is cut).

Where the encoder's input comes from: our shards hold latents, so the step decodes the clean latent with
the data's own autoencoder (frozen, as the encoder) and resizes the image to the encoder's input; nothing
more is stored (BENCHMARKS.md compares this with storing crops or features at conversion). The input is
sized so that the encoder's patch grid is the denoiser's token grid (``encoder_input: token_grid``, the
default): tokens × the encoder's patch per side, which is REPA's 224·(resolution/256) for DINOv2's 14-pixel
patches on an f8 autoencoder with 2×2 patches (SD3's MMDiT, Flux), i.e. 224 px at 256 and 896 at 1024
(DINOv2's hub config says 518: 37×37 patches, 6.5× the encoder's FLOPs, resampled down). The encoder's
position embeddings are interpolated to that grid (transformers' ``interpolate_pos_encoding``).
``encoder_input: encoder_config`` keeps what this module did before: the config's ``image_size``, its
patch grid resized to the token grid.

Precision: under ``amp_bf16`` the frozen encoder and autoencoder are cast to bf16 once at fit start
(:class:`RepaSwitch`), on every rank: half their memory, and no per-step cast of their weights; under fp32
and ``amp_fp16`` they stay fp32 (an fp16 VAE decode can overflow; autocast still runs their matmuls in
fp16). Their features are compared in fp32. With patch masking or token routing only the tokens
the block computed (the kept, or the routed-through, patches) are aligned, as PRX does.

The projector is a child module (``repa.projector.*``): trained, saved in checkpoints and averaged by the
EMA like the denoiser. Sampling and export read ``denoiser.*`` only, so they never see it, and a checkpoint
without it loads into a REPA run (a fresh projector) as one with it loads into a run without REPA. The
encoder and the autoencoder are not children (as the frozen text encoder): out of the optimizer, the EMA,
checkpoints and FSDP's wrapping; each rank holds a whole copy.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from composer.core import Algorithm, Event

from diffusion.errors import ConfigError

PREFIX = "repa."  # the ComposerModel's state-dict prefix of the projector


def _sd3_blocks(module):
    return list(module.transformer_blocks)


def _flux_blocks(module):  # the double-stream blocks, then the single-stream ones: both return (text, image)
    return list(module.transformer_blocks) + list(module.single_transformer_blocks)


# Per denoiser class: its blocks in order, the image tokens of a block's output, the side of a token's patch
# in latent pixels (Flux packs 2×2 latent pixels per token).
BLOCKS = {
    "SD3Transformer2DModel": (_sd3_blocks, lambda out: out[1], lambda config: int(config["patch_size"])),
    "FluxTransformer2DModel": (_flux_blocks, lambda out: out[1], lambda config: 2),
    "SanaTransformer2DModel": (_sd3_blocks, lambda out: out, lambda config: int(config.get("patch_size") or 1)),
}


class Projector(torch.nn.Sequential):
    """REPA's projector: Linear–SiLU–Linear–SiLU–Linear from the block's width to the encoder's."""

    def __init__(self, width: int, hidden: int, features: int):
        super().__init__(torch.nn.Linear(width, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, hidden),
                         torch.nn.SiLU(), torch.nn.Linear(hidden, features))


def alignment(projected: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """(B,): minus the mean over tokens of the cosine similarity of (B, K, D) projections and features."""
    return -F.cosine_similarity(projected.float(), features.float(), dim=-1).mean(dim=1)


class FrozenVisionEncoder:
    """The frozen encoder and its input: ``features(images)`` gives (B, N, D) patch features on a
    (grid × grid) patch grid, from images in [-1, 1] resized to the encoder's input size and normalised
    as its preprocessor says. Not an ``nn.Module`` child (see the module's doc); moved to the batch's
    device at its first call."""

    def __init__(self, model, preprocessing: dict, input_rule: str = "token_grid"):
        import inspect
        self.model = model
        config = model.config
        self.image_size = int(config.image_size if isinstance(config.image_size, int) else config.image_size[0])
        self.patch = int(config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0])
        self.grid = self.image_size // self.patch
        self.width = int(config.hidden_size)
        self.input_rule = input_rule
        # ViT and SigLIP interpolate their position embeddings only when asked; DINOv2 and DINOv3 always can
        self._interpolate = "interpolate_pos_encoding" in inspect.signature(model.forward).parameters
        self.mean = torch.tensor(preprocessing["image_mean"], dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(preprocessing["image_std"], dtype=torch.float32).view(1, 3, 1, 1)

    def input_size(self, rows: int, columns: int) -> tuple[int, int]:
        """The encoder's input (height, width) in pixels for a denoiser's (rows × columns) token grid: each
        token one encoder patch (``token_grid``), or the config's ``image_size`` (``encoder_config``)."""
        if self.input_rule == "encoder_config":
            return self.image_size, self.image_size
        return rows * self.patch, columns * self.patch

    def to(self, device) -> "FrozenVisionEncoder":
        self.model.to(device)
        self.mean, self.std = self.mean.to(device), self.std.to(device)
        return self

    @torch.no_grad()
    def features(self, images: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """(B, N, D) patch features of ``images`` resized to ``size`` (default the config's ``image_size``):
        N = (height / patch) × (width / patch)."""
        if self.mean.device != images.device:
            self.to(images.device)
        size = tuple(size) if size is not None else (self.image_size, self.image_size)
        x = F.interpolate(images.float(), size=size, mode="bicubic", align_corners=False, antialias=True)
        x = ((x.clamp(-1, 1) + 1) / 2 - self.mean) / self.std
        dtype = next(self.model.parameters()).dtype
        other = size != (self.image_size, self.image_size)
        extra = {"interpolate_pos_encoding": True} if self._interpolate and other else {}
        states = self.model(pixel_values=x.to(dtype), **extra).last_hidden_state
        patches = (size[0] // self.patch) * (size[1] // self.patch)
        return states[:, -patches:].float()  # the patch tokens: after CLS and any registers


class LatentDecoder:
    """The data's autoencoder, frozen: the denoiser's (scaled) latent back to an image in [-1, 1]."""

    def __init__(self, vae, space):
        self.vae, self.space = vae, space

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        if next(self.vae.parameters()).device != latents.device:
            self.vae.to(latents.device)
        z = latents / self.space.scaling_factor + self.space.shift_factor
        dtype = next(self.vae.parameters()).dtype
        return self.vae.decode(z.to(dtype)).sample.float().clamp(-1, 1)


class Repa(torch.nn.Module):
    """``model.repa`` on one denoiser: the projector (a child), the frozen encoder and decoder (not children),
    the block whose output is aligned, and whether the alignment is on (:class:`RepaSwitch`)."""

    def __init__(self, denoiser, adapter, encoder: FrozenVisionEncoder, decoder: LatentDecoder | None, *,
                 block: int, weight: float, until: int | None, projector_dim: int):
        super().__init__()
        name = adapter.class_name
        if name not in BLOCKS:
            raise ConfigError(f"model.repa: {name} has no image tokens to align; representation alignment needs a "
                              f"transformer denoiser ({', '.join(BLOCKS)})")
        blocks, self._image_tokens, patch = BLOCKS[name]
        count = len(blocks(denoiser))
        if not 1 <= block <= count:
            raise ConfigError(f"model.repa.block={block}: the {name} has {count} blocks; align the output of one of "
                              f"blocks 1 to {count}")
        config = dict(denoiser.config)
        width = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
        self.projector = Projector(width, int(projector_dim), encoder.width)
        self._blocks, self.block, self.patch = blocks, int(block), patch(config)
        self.weight, self.until = float(weight), until
        # plain attributes, not children: kept out of state_dict, parameters(), EMA and FSDP
        self.__dict__["encoder"], self.__dict__["decoder"] = encoder, decoder
        self.active = until is None or until > 0
        self.__dict__["_slot"] = {}  # where the block's hook writes while :meth:`capture` says so
        blocks(denoiser)[self.block - 1].register_forward_hook(self._keep)

    def switch(self, batch: int) -> None:
        """On before batch ``until``, off from it (``batch``: the batches trained so far)."""
        self.active = self.until is None or int(batch) < self.until

    def capture(self, into: dict | None) -> None:
        """From now on ``into["tokens"]`` gets the image tokens after the aligned block each time the denoiser
        runs; None stops it. The hook that writes them stays on the block from the start (registered once,
        not per step), so a compiled step traces it as part of its graph."""
        self._slot["into"] = into

    def _keep(self, module, args, output) -> None:
        into = self._slot.get("into")
        if into is not None:
            into["tokens"] = self._image_tokens(output)

    def target(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, N, D): the encoder's features of the decoded clean latents, on the denoiser's token grid."""
        images = self.decoder(latents) if self.decoder is not None else latents
        height, breadth = latents.shape[-2] // self.patch, latents.shape[-1] // self.patch
        size = self.encoder.input_size(height, breadth)
        features = self.encoder.features(images, size)
        batch, _, width = features.shape
        grid = (size[0] // self.encoder.patch, size[1] // self.encoder.patch)
        features = features.transpose(1, 2).reshape(batch, width, *grid)
        if (height, breadth) != grid:
            features = F.interpolate(features, size=(height, breadth), mode="bilinear", align_corners=False,
                                     antialias=True)
        return features.flatten(2).transpose(1, 2)

    def forward(self, tokens: torch.Tensor, latents: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """(B,): the alignment of the captured ``tokens`` (B, K, width) with the features of the tokens the
        block computed: all of them, or the patches ``kept`` lists (masking's keep, routing's route) when
        the block saw only those. Called as the module (``repa(tokens, latents, kept)``): under FSDP1
        Composer wraps each child of the model as its own unit, and only its forward gathers the projector."""
        features = self.target(latents)
        if tokens.shape[1] != features.shape[1]:
            if kept is None or kept.shape[1] != tokens.shape[1]:
                raise ValueError(f"model.repa: block {self.block} gave {tokens.shape[1]} image tokens, and the "
                                 f"latents have {features.shape[1]} patches")
            index = kept.to(device=features.device, dtype=torch.long)[..., None].expand(-1, -1, features.shape[-1])
            features = features.gather(1, index)
        return alignment(self.projector(tokens), features)

    # ---- FLOPs (for MFU) ----------------------------------------------------------------------------------
    def flops_per_image(self, latent_shape, tokens: int) -> float:
        """Training FLOPs REPA adds per image: the decode and the encoder's forward, the projector's forward
        and backward (3×) over ``tokens``; counted by torch on the meta device."""
        channels, height, width = latent_shape
        decode = _decode_flops(self.decoder, channels, height, width) if self.decoder is not None else 0
        size = self.encoder.input_size(height // self.patch, width // self.patch)
        return decode + _encoder_flops(self.encoder.model, size) + 3 * _projector_flops(self.projector, tokens)

    def use_compute_dtype(self, dtype: torch.dtype) -> None:
        """The frozen encoder and autoencoder in ``dtype`` (bf16 under ``amp_bf16``: see the module's doc)."""
        self.encoder.model.to(dtype=dtype)
        if self.decoder is not None:
            self.decoder.vae.to(dtype=dtype)


def _count(factory, shape, call) -> int:
    """FLOPs of ``call(module, input)`` for the module ``factory`` builds, on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode
    with torch.device("meta"):
        module = factory()
        x = torch.empty(*shape)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        call(module, x)
    return counter.get_total_flops()


def _decode_flops(decoder: LatentDecoder, channels: int, height: int, width: int) -> int:
    return _cached_decode_flops(type(decoder.vae), _config_key(decoder.vae.config), channels, height, width)


@functools.lru_cache(maxsize=8)
def _cached_decode_flops(cls, config_key, channels, height, width) -> int:
    config = dict(config_key)
    return _count(lambda: cls.from_config(config), (1, channels, height, width),
                  call=lambda vae, z: vae.decode(z))


def _encoder_flops(model, size: tuple[int, int] | None = None) -> int:
    """The encoder's forward FLOPs on one image of ``size`` (height, width; default its config's)."""
    return _cached_encoder_flops(type(model), model.config.to_json_string(), tuple(size) if size else None)


@functools.lru_cache(maxsize=8)
def _cached_encoder_flops(cls, config_json, size) -> int:
    import inspect
    config = cls.config_class.from_dict(__import__("json").loads(config_json))
    default = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    size = size or (default, default)
    extra = {"interpolate_pos_encoding": True} if size != (default, default) and (
        "interpolate_pos_encoding" in inspect.signature(cls.forward).parameters) else {}
    return _count(lambda: cls(config), (1, 3, *size), call=lambda m, x: m(pixel_values=x, **extra))


def _projector_flops(projector: Projector, tokens: int) -> int:
    return sum(2 * tokens * layer.in_features * layer.out_features for layer in projector
               if isinstance(layer, torch.nn.Linear))


def _config_key(config) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in dict(config).items()
                        if not k.startswith("_")))


# ---- the model's hooks ------------------------------------------------------------------------------------

def state_dict_hooks(model) -> None:
    """A run without REPA loads a checkpoint with a projector (its tensors dropped); a REPA run loads one
    without any (the projector starts fresh): phases may add or drop the alignment."""
    def drop(state_dict, prefix, *args):
        if getattr(model, "repa", None) is None:
            for key in [k for k in state_dict if k.startswith(prefix + PREFIX)]:
                del state_dict[key]

    def fresh(module, incompatible):
        repa = getattr(model, "repa", None)
        missing = [k for k in incompatible.missing_keys if k.startswith(PREFIX)]
        if repa is not None and len(missing) == len(repa.state_dict()):  # none held: not a partial one
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(PREFIX)]

    model._register_load_state_dict_pre_hook(drop)
    model.register_load_state_dict_post_hook(fresh)


class RepaSwitch(Algorithm):
    """Turns the alignment off from batch ``model.repa.until`` on: set before every batch from the trainer's
    batch count (restored on resume, so a resumed run switches at the same batch). Once off, the projector
    is not called, gets no gradient, and the optimizer leaves it (under FSDP1 too: it is its own unit,
    which no forward gathers any more)."""

    def __init__(self, repa: Repa):
        self.repa = repa

    def match(self, event, state) -> bool:
        return event in (Event.FIT_START, Event.BATCH_START)

    def apply(self, event, state, logger) -> None:
        if event == Event.FIT_START:  # the frozen encoder and autoencoder in the run's compute dtype
            from composer.core import Precision
            if state.precision == Precision.AMP_BF16:
                self.repa.use_compute_dtype(torch.bfloat16)
        self.repa.switch(int(state.timestamp.batch))


def build(model_cfg, denoiser, adapter, info, seed: int = 0) -> Repa | None:
    """``model.repa`` for ``denoiser`` on data ``info`` (its autoencoder decodes the latents), or None; the
    projector's initial weights from ``seed`` (the global RNG is left as it was, as for the denoiser)."""
    r = getattr(model_cfg, "repa", None)
    if r is None:
        return None
    from diffusion.models import loading
    import transformers
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # an unused pooler the checkpoint lacks is not news
    try:
        with torch.random.fork_rng(devices=[]):
            model, preprocessing = loading.load_image_encoder(r.encoder)
    finally:
        transformers.logging.set_verbosity(verbosity)
    if "image_size" not in model.config.to_dict() or "patch_size" not in model.config.to_dict():
        raise ConfigError(f"model.repa.encoder={r.encoder}: a {type(model).__name__} has no image_size and "
                          f"patch_size: give a ViT-style encoder (DINOv2, DINOv3, SigLIP, ViT)")
    decoder = LatentDecoder(loading.load_vae(info.model), info.latent_space)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        encoder = FrozenVisionEncoder(model, preprocessing, getattr(r, "encoder_input", "token_grid"))
        return Repa(denoiser, adapter, encoder, decoder, block=r.block,
                    weight=r.weight, until=r.until, projector_dim=r.projector_dim)
