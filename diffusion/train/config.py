"""The training configuration: YAML + dotted ``key=value`` overrides → a typed, validated :class:`Config`.

    cfg = load_config("yamls/sd2-base-256.yaml", ["trainer.max_duration=100ba", "optimizer.lr=2e-4"])

Every key is checked against the dataclasses below before anything is built, so a misspelt key fails at
start with its dotted path, the valid keys and the closest match. ``algorithms``, ``callbacks`` and
``loggers`` are maps ``name → keyword arguments``; the names are looked up in :mod:`diffusion.train.components`
and the arguments checked against the component's signature (``name: null`` switches one off).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Literal, Optional, Union

from diffusion.train import components
from diffusion.convert.settings import PipelineSettings
from diffusion.errors import ConfigError
from diffusion.storage import same_place_key
from diffusion.yaml_file import parse_yaml as _parse_yaml


@dataclasses.dataclass
class FlowConfig:
    """``model.objective: flow`` (rectified flow, as SD3): how σ is drawn, shifted and weighted."""

    sigma_density: Literal["logit_normal", "uniform", "mode"] = "logit_normal"
    logit_mean: float = 0.0  # logit_normal: u = sigmoid(N(mean, std))
    logit_std: float = 1.0
    mode_scale: float = 1.29  # mode: SD3's heavy-tails scale
    shift: float = 1.0  # σ' = shift·σ / (1 + (shift-1)·σ): > 1 trains more at high noise (SD3: 3.0 at 1024 px)
    shift_base_resolution: Optional[int] = None  # set: shift·R/R_base at resolution R (SD3's α = √(m/n))
    weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"  # SD3's loss weightings
    # The x0-preconditioned loss of diffusers' SD3 training scripts (their --precondition_outputs): the
    # prediction read as x0 = x_σ − σ·v against the clean latent, which is the velocity loss weighted by σ²
    # (times the weighting above); false: the velocity loss
    precondition_outputs: bool = False
    num_train_timesteps: int = 1000  # discrete σ (the flow-matching scheduler's), timestep = σ·T


@dataclasses.dataclass
class MaskingConfig:
    """Deferred patch masking (MicroDiT) for a transformer denoiser: the first ``mixer_blocks`` blocks see
    every latent patch, the rest only ``1 - ratio`` of them, and the loss is taken over those."""

    ratio: float = 0.0  # share of patches dropped per sample (0.75 in MicroDiT); 0: off
    mixer_blocks: int = 1  # blocks that see all patches (the patch mixer)


@dataclasses.dataclass
class RoutingConfig:
    """Token routing (TREAD) for a transformer denoiser: ``ratio`` of each sample's image tokens skip the
    blocks ``start`` to ``end - 1`` and rejoin, unchanged, after them; every patch is predicted and in the
    loss. ``end`` below 1 counts from the last block (0: through the last one, -1: all but the last)."""

    ratio: float = 0.0  # share of image tokens routed around the span (0.5 in TREAD); 0: off
    start: int = 1  # the first block of the span (the blocks before it see every token)
    end: int = -1  # one past the span's last block


@dataclasses.dataclass
class RepaConfig:
    """Representation alignment (REPA, Yu et al. 2024) for a transformer denoiser: a small MLP maps the
    image tokens after block ``block`` to a frozen vision encoder's patch features of the clean image
    (the latent decoded by the data's autoencoder in the step), and ``weight`` × their negative cosine
    similarity is added to the loss, until batch ``until`` (:mod:`diffusion.models.repa`)."""

    encoder: str = ""  # a transformers vision encoder (AutoModel): hub id or local directory
    block: int = 8  # align the output of this block (1 = the first); PRX: 8
    weight: float = 0.5  # λ of the alignment loss (REPA, PRX: 0.5)
    until: Optional[int] = None  # the batch from which it is off (PRX: ~200k); null: never
    projector_dim: int = 2048  # the projector MLP's hidden width (REPA: 2048)
    # the encoder's input size: token_grid = its patch grid is the denoiser's token grid (REPA's rule: DINOv2 at
    # 224 px for 256 px on an f8 VAE with 2x2 patches); encoder_config = its config's image_size (518 for
    # DINOv2's hub configs), the grid resampled to the tokens (what this repository did before issue 47)
    encoder_input: Literal["token_grid", "encoder_config"] = "token_grid"


@dataclasses.dataclass
class ModelConfig:
    ref: str = "stabilityai/stable-diffusion-2-base"  # hub id or diffusers directory (denoiser config, scheduler)
    # the diffusers denoiser class (UNet2DConditionModel, SD3Transformer2DModel); auto: the reference's
    # transformer/ component where it has one, else its unet/
    denoiser: str = "auto"
    # epsilon, v_prediction (DDPM schedule) or flow (rectified flow); None: model.prediction_type
    objective: Optional[str] = None
    pretrained: Optional[str] = None  # a diffusers denoiser directory (or model ref with its weights) to start from
    resolution: int = 256  # pixels per side; selects the vae_moments_{R} column
    prediction_type: Optional[Literal["epsilon", "v_prediction"]] = None  # None: the scheduler config's
    offset_noise: float = 0.0  # std of a per-channel constant added to the noise
    min_snr_gamma: Optional[float] = None  # min-SNR-γ loss weighting (5.0 in the paper); None: uniform
    # min-SNR gives the zero-terminal-SNR step (SNR = 0) weight 0; a floor keeps it trained (e.g. 0.1)
    min_snr_floor: float = 0.0
    flow: FlowConfig = dataclasses.field(default_factory=FlowConfig)
    eval_bins: int = 0  # > 0: also the held-out loss at this many fixed noise levels (metrics loss_bin{k})
    # with eval_bins: "mlperf" (MLPerf's: held-out sample i at level i mod bins, sigma = k/bins, one denoiser
    # call a sample) or "all_levels" (every sample at every bin's slice centre: bins + 1 calls a sample)
    eval_protocol: Literal["mlperf", "all_levels"] = "mlperf"
    masking: MaskingConfig = dataclasses.field(default_factory=MaskingConfig)  # training only: eval never masks
    routing: RoutingConfig = dataclasses.field(default_factory=RoutingConfig)  # training only: eval never routes
    zero_terminal_snr: bool = False  # rescale betas so the last timestep is pure noise (needs v_prediction)
    input_perturbation: float = 0.0  # extra noise on the UNet input only (0.1 in the paper)
    eval_seed: int = 0  # pins eval noise and timesteps per held-out sample
    # What the UNet is conditioned on: "embeds" the stored text embeddings; "ids" the stored token ids,
    # run through the frozen text encoder on the training device each step (datasets converted with
    # --text ids); "auto" embeddings where every dataset holds them, else ids.
    text: Literal["auto", "embeds", "ids"] = "auto"
    text_encoder: Optional[str] = None  # text=ids: model reference of the text encoder (None: the dataset's)
    # The denoiser attends to each caption's tokens only, not its padding (the UNet's encoder_attention_mask,
    # the MMDiT's joint attention), from the token counts the dataset stores; None: on for a T5 text
    # encoder (long padded captions), off for CLIP (SD2 trained on the padded embeddings).
    text_mask: Optional[bool] = None
    repa: Optional[RepaConfig] = None  # representation alignment to a frozen vision encoder; null: off
    # A guidance-distilled denoiser (Flux.1-dev's shape: guidance_embeds true) reads this value in its
    # guidance embedding while training, as diffusers' Flux training scripts pass --guidance_scale; null: 1.0.
    # Refused for a denoiser without a guidance embedding
    embedded_guidance: Optional[float] = None


DEFAULT_MDS_PATH = "out/demo/mds"  # data.train.path (and data.eval.path) when neither path nor streams is set


@dataclasses.dataclass
class StreamConfig:
    """One dataset of a weighted mix (``data.train.streams``): streaming's ``Stream`` weights, at most
    one of ``proportion`` (a share of the epoch: every stream gives one, or none does), ``repeat``
    (a multiple of its samples) or ``choose`` (a number of samples per epoch); none: all its samples."""

    path: str = ""  # local directory or remote URI of MDS shards written by convert/laion_to_mds.py
    local: Optional[str] = None  # cache directory for a remote path (default: a temp dir per remote)
    proportion: Optional[float] = None
    repeat: Optional[float] = None
    choose: Optional[int] = None


@dataclasses.dataclass
class TrainLoaderConfig:
    source: Literal["mds", "stream"] = "mds"  # stored MDS shards, or the converter's operators streamed live
    path: Optional[str] = None  # local directory or remote URI (s3://, gs://, ...) of MDS shards (default out/demo/mds)
    streams: Optional[list[StreamConfig]] = None  # a weighted mix of datasets, in place of path
    local: Optional[str] = None  # cache directory for remote shards (default: a temp dir per remote)
    batch_size: int = 2048  # global: divided evenly across ranks
    caption_dropout: float = 0.1  # fraction of samples given the empty-caption embedding
    # Several captions per image (a dataset converted with --captions): {caption name: probability}, one
    # drawn per sample and epoch, e.g. {caption: 0.3, recap: 0.7}; None: the first caption only
    captions: Optional[dict[str, float]] = None
    shuffle: bool = True
    shuffle_seed: int = 9176
    num_workers: int = 8
    prefetch_factor: Optional[int] = 2
    persistent_workers: bool = True
    predownload: Optional[int] = None
    cache_limit: Optional[str] = None  # e.g. "100gb"; evict downloaded shards past this
    num_canonical_nodes: Optional[int] = None
    download_timeout: float = 120.0
    num_samples: Optional[int] = None  # samples per epoch (streaming's epoch_size); None: all
    verify_shards: bool = True  # hash each shard once per node before reading it (sizes and headers: always)


@dataclasses.dataclass
class EvalLoaderConfig(TrainLoaderConfig):
    batch_size: int = 64
    caption_dropout: float = 0.0
    shuffle: bool = False
    num_workers: int = 2
    persistent_workers: bool = False


@dataclasses.dataclass
class OnlineConfig(PipelineSettings):
    """Online mode (``python -m diffusion.online``): raw rows are transformed and encoded while training.

    The pipeline's settings (columns, image checks, transform and encoder pools) are the converter's
    own (:class:`~diffusion.convert.settings.PipelineSettings`, the same names as its flags without
    dashes). ``data.train`` still gives the global batch size and caption dropout. Pool sizes left at
    null are planned from the cluster as the converter plans them, after the training workers' share.
    """

    input: str = ""  # raw image-caption data (parquet, webdataset tars, image folder), local or s3://
    work_dir: str = "out/online"  # Ray Train run records and reject records (shared storage on a cluster)
    num_train_workers: int = 2  # Ray Train workers (one Composer rank each)
    train_cpus: float = 0.25  # per training worker (on 2 CPUs, the rest goes to the pools and a 1-CPU read)
    train_gpus: float = 0.0  # per training worker; > 0 trains on GPUs
    train_accelerator_type: Optional[str] = None  # e.g. "H100": training workers only on such GPUs
    max_failures: int = 1  # worker-group restarts (each resumes from the last checkpoint); -1: unlimited


@dataclasses.dataclass
class DataConfig:
    train: TrainLoaderConfig = dataclasses.field(default_factory=TrainLoaderConfig)
    eval: Optional[EvalLoaderConfig] = None  # held-out set for the pinned-noise eval loss
    online: Optional[OnlineConfig] = None  # only read by online mode (python -m diffusion.online)


@dataclasses.dataclass
class OptimizerConfig:
    """The optimizer and its parameter groups (:mod:`diffusion.train.optimizers`)."""

    # adamw: torch's AdamW; muon: timm's Muon on the hidden matrices (the Linear and convolution weights
    # inside the denoiser's blocks, kernels flattened), its AdamW fallback on embeddings, norms, biases,
    # input and final projections
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 1.0e-4  # muon: the same for both (Muon's updates are scaled to AdamW's RMS)
    weight_decay: float = 0.01
    # all: every trainable tensor decays (as every YAML trained so far); weights: weight matrices and
    # kernels only, not norms, biases or embeddings
    decay: Literal["all", "weights"] = "all"
    # AdamW's (muon: its fallback's); null: [0.9, 0.999] for adamw, [0.9, 0.95] for muon's fallback (KellerJordan's)
    betas: Optional[list[float]] = None
    eps: float = 1.0e-8  # AdamW's (muon: its fallback's)
    fused: Optional[bool] = None  # None: fused on CUDA (AdamW)
    momentum: float = 0.95  # muon: the Muon update's momentum
    # muon: Nesterov momentum. null: on for the Muon update, plain AdamW for the fallback (KellerJordan's);
    # true: also NAdamW for the fallback (timm's); false: off for both (what this repository trained before)
    nesterov: Optional[bool] = None
    # muon: the Newton–Schulz coefficients: original = KellerJordan's (3.4445, -4.7750, 2.0315) every step;
    # quintic = timm's default (a per-step schedule; what this repository trained before); polar_express*
    ns_coefficients: Literal["original", "quintic", "polar_express", "polar_express_safer"] = "original"
    ns_eps: float = 1.0e-7  # muon: Newton–Schulz's ε (the gradient's norm + ε), apart from the fallback's eps


@dataclasses.dataclass
class SchedulerConfig:
    name: Literal["constant_with_warmup", "linear_with_warmup", "cosine_with_warmup"] = "constant_with_warmup"
    t_warmup: str = "10000ba"
    alpha_f: float = 0.0  # final LR multiplier of the linear/cosine decays


@dataclasses.dataclass
class FSDPSection:
    # 1: torch's FullyShardedDataParallel, the path the suite runs (EMA swap, checkpoints, NaN stop).
    # 2: torch's fully_shard (Composer's FSDP2Config): sharding_strategy FULL_SHARD or SHARD_GRAD_OP only
    #    (as reshard_after_forward), a number for device_train_microbatch_size (Composer's 'auto' fails
    #    there). Chosen here, not by Composer's FSDP_VERSION environment variable, so a YAML means one thing.
    version: Literal[1, 2] = 1
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                               "_HYBRID_SHARD_ZERO2"] = "SHARD_GRAD_OP"
    mixed_precision: str = "DEFAULT"  # Composer's FSDP mixed precision preset
    state_dict_type: Literal["full", "sharded"] = "full"  # sharded: not with algorithms.ema (saved full)
    limit_all_gathers: bool = True
    forward_prefetch: bool = False
    backward_prefetch: str = "BACKWARD_POST"
    # Hybrid sharding (sharding_strategy HYBRID_SHARD, or _HYBRID_SHARD_ZERO2 to keep the gathered weights
    # after forward), versions 1 and 2: Composer's device mesh (replicate, shard). Each weight is sharded over
    # data_parallel_shard_degree ranks and replicated data_parallel_replicate_degree times; -1 / null fill in
    # the world size; both unset: shard within a node (its ranks), replicate across nodes.
    data_parallel_shard_degree: int = -1
    data_parallel_replicate_degree: Optional[int] = None


@dataclasses.dataclass
class TrainerConfig:
    run_name: Optional[str] = None
    seed: int = 17
    max_duration: str = "550000ba"  # express in batches: streaming epochs are not fixed under resumption
    eval_interval: str = "10000ba"
    eval_subset_num_batches: int = -1
    device: Optional[Literal["cpu", "gpu"]] = None  # None: gpu when available
    device_train_microbatch_size: Union[int, Literal["auto"], None] = None  # None: the whole device batch
    precision: Optional[Literal["fp32", "amp_bf16", "amp_fp16"]] = None  # None: amp_bf16 on GPU, fp32 on CPU
    grad_clip_norm: Optional[float] = 1.0
    # log the pre-clip norm (l2_norm/grad/global_before_clip) every this many batches: the host waits for
    # the norm only then (clipping itself never waits)
    grad_norm_log_interval: int = 1
    fsdp: Optional[FSDPSection] = None  # null: DDP
    activation_checkpointing: bool = False
    channels_last: bool = False
    # torch.compile: the whole model (Composer's compile_config); under FSDP each wrapped block on its own,
    # whole (fullgraph), as FSDP units break a whole-model graph at every unit
    compile: bool = False
    compile_mode: Optional[Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]] = None
    compile_backend: str = "inductor"  # torch.compile's backend (aot_eager: graphs without code generation)
    save_folder: Optional[str] = None
    save_interval: str = "10000ba"
    save_num_checkpoints_to_keep: int = -1
    save_overwrite: bool = False
    autoresume: bool = False
    # with autoresume, a save folder whose checkpoints are all unreadable (cut, or not ours) is refused
    # rather than trained over from batch 0; true starts from the beginning (they stay, set aside)
    start_fresh: bool = False
    load_path: Optional[str] = None
    load_weights_only: bool = False  # phase 2: weights only, fresh optimizer and schedule
    load_strict: bool = True
    dist_timeout: float = 300.0


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    algorithms: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    callbacks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    loggers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- reading ---------------------------------------------------------------------------------------

def load_config(path: Optional[str] = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read ``path`` (YAML), apply ``key=value`` overrides (values parsed as YAML), validate."""
    raw: dict = {}
    if path:
        with open(path) as f:
            raw = _parse_yaml(f, path)
        if raw is None:  # an empty file trained the dataclass defaults: SD2-base from the hub
            raise ConfigError(f"{path}: empty (no sections); start from a recipe, e.g. yamls/tiny-cpu.yaml")
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    for override in overrides:
        apply_override(raw, override)
    return from_dict(raw)


def apply_override(raw: dict, override: str) -> None:
    """Set ``a.b.c=value`` in the nested dict ``raw`` (creating mappings on the way)."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} is not key=value (e.g. trainer.max_duration=100ba)")
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = _parse_yaml(value, f"override {override!r}") if value.strip() else None


def from_dict(raw: dict) -> Config:
    cfg = _build(Config, raw, "")
    _check_components(cfg)
    _check_consistency(cfg)
    return cfg


def _build(cls, raw: Any, where: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            raise ConfigError(_unknown_key(f"{where}{key}", str(key), list(fields)))
    kwargs = {name: _coerce(value, hints[name], f"{where}{name}") for name, value in raw.items()}
    return cls(**kwargs)


def _unknown_key(path: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown config key {path!r}{hint} Valid keys here: {', '.join(sorted(valid))}"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (ints may stand for floats), recursing into sections."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where + ".")
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as e:
                if dataclasses.is_dataclass(option):
                    raise  # a section's own error is more useful than "not a ..."
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} is not valid ({'; '.join(errors)})")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}{hint}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        _, item = typing.get_args(tp)
        # a null entry is kept: in algorithms/callbacks/loggers it switches that component off
        return {k: None if v is None else _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isnan(value):  # no setting means "not a number"; null is how a setting is left unset
            raise ConfigError(f"{where}: NaN is not a valid value")
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _check_components(cfg: Config) -> None:
    """Names of algorithms/callbacks/loggers exist; their keyword arguments match the signatures."""
    for section, registry in (("algorithms", components.ALGORITHMS), ("callbacks", components.CALLBACKS),
                              ("loggers", components.LOGGERS)):
        entries = getattr(cfg, section)
        for name in list(entries):
            if entries[name] is None:
                continue
            if name not in registry:
                raise ConfigError(_unknown_key(f"{section}.{name}", name, list(registry)))
            components.check_kwargs(section, name, entries[name])
        setattr(cfg, section, {k: v for k, v in entries.items() if v is not None})


# A duration: a number, then its unit. Batches and samples are whole numbers; "dur" is a fraction
# of max_duration. Epochs are refused: streaming epochs change length on resumption.
_DURATION = re.compile(r"^(?P<number>\d+|\d*\.\d+|\d+\.\d*)(?P<unit>ba|sp|dur)$")


def _check_duration(key: str, value: str, positive: bool = True, fraction: bool = True) -> None:
    """``fraction``: whether a fraction of trainer.max_duration ("0.1dur") is allowed (not for max_duration)."""
    match = _DURATION.match(value.strip()) if isinstance(value, str) else None
    if match is None or (not fraction and match.group("unit") == "dur"):
        fraction = ", or as a fraction of trainer.max_duration ('0.1dur')" if fraction else ""
        raise ConfigError(f"{key}={value!r}: give it as a number and a unit, in batches ('1000ba') or samples "
                          f"('...sp'){fraction}; streaming epochs change length on resumption")
    number, unit = match.group("number"), match.group("unit")
    if unit != "dur" and not number.isdigit():
        raise ConfigError(f"{key}={value!r}: batches and samples are whole numbers")
    if positive and float(number) <= 0:
        raise ConfigError(f"{key}={value!r} must be more than zero")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


ONLINE_LOADER_KEYS = ("source", "batch_size", "caption_dropout")  # what online mode reads of data.train


def unread_online_keys(loader: TrainLoaderConfig) -> list[str]:
    """The ``data.train`` keys set away from their defaults that online mode (``source: stream``) never reads:
    it draws raw rows from ``data.online.input``, so the stored shards' path, cache, shuffling and loader
    workers do not apply. Call before the loader workers are sized to the machine."""
    defaults = TrainLoaderConfig()
    unread = []
    for field in dataclasses.fields(TrainLoaderConfig):
        value = getattr(loader, field.name)
        if field.name in ONLINE_LOADER_KEYS or value == getattr(defaults, field.name):
            continue
        if field.name == "path" and value == DEFAULT_MDS_PATH and loader.streams is None:
            continue  # filled in by the config's own checks, not given
        unread.append(f"data.train.{field.name}={value}")
    return unread


def _check_streams(name: str, loader: TrainLoaderConfig) -> None:
    """``path`` or ``streams``, never both (neither: the demo's path); stream weights as streaming takes them."""
    if loader.streams is None:
        if loader.path is None:
            loader.path = DEFAULT_MDS_PATH
        return
    _require(name == "train", f"data.{name}.streams: the held-out set is one dataset; give data.{name}.path")
    _require(loader.path is None, f"data.{name}.path={loader.path} and data.{name}.streams are both set: give "
                                  f"one dataset as path, or a mix as streams (set data.{name}.path=null)")
    _require(len(loader.streams) > 0, f"data.{name}.streams is empty: list at least one {{path: ...}}")
    _require(loader.source == "mds", f"data.{name}.streams needs data.{name}.source=mds (stored shards)")
    _require(loader.local is None, f"data.{name}.local={loader.local} is for data.{name}.path: give each stream "
                                   f"its own local (data.{name}.streams[i].local)")
    key = f"data.{name}.streams"
    weights = []
    for i, stream in enumerate(loader.streams):
        _require(bool(stream.path), f"{key}[{i}].path is not set: each stream is {{path: ..., proportion: ...}}")
        given = [w for w in ("proportion", "repeat", "choose") if getattr(stream, w) is not None]
        _require(len(given) <= 1, f"{key}[{i}] ({stream.path}) sets {' and '.join(given)}: give at most one of "
                                  f"proportion, repeat, choose")
        for w in given:
            _require(getattr(stream, w) >= 0, f"{key}[{i}].{w}={getattr(stream, w)} must not be negative")
        weights.append(given[0] if given else None)
    if "proportion" in weights:
        bad = next((i for i, w in enumerate(weights) if w != "proportion"), None)
        _require(bad is None, f"{key}[{bad}] ({loader.streams[bad].path if bad is not None else ''}) has no "
                              f"proportion while another stream has one: give every stream a proportion, or "
                              f"none a proportion (repeat, choose)")
        _require(sum(s.proportion for s in loader.streams) > 0, f"{key}: the proportions add up to 0")
    elif any(weights):
        _require(loader.num_samples is None, f"data.{name}.num_samples sets the epoch size of a mix weighted by "
                                             f"proportion; with repeat or choose the streams decide it: set "
                                             f"data.{name}.num_samples=null")
    places = [same_place_key(s.path) for s in loader.streams]  # data/a and data/./a are one dataset
    for i, place in enumerate(places):
        if place in places[:i]:
            raise ConfigError(f"{key} lists {place} twice (as {loader.streams[places.index(place)].path} and "
                              f"{loader.streams[i].path}): give it once, with a larger proportion or repeat")


def _check_unread_settings(m: ModelConfig) -> None:
    """Refuse, in one line naming it, a key the objective's own other settings leave unread (issue 47 item 7):
    the logit-normal draw's mean and std under another ``sigma_density``, ``mode_scale`` off the mode draw,
    ``min_snr_floor`` without min-SNR weighting; and a min-SNR γ that is not positive (it would weight the
    loss by min(SNR, γ)/SNR ≤ 0)."""
    f, default = m.flow, FlowConfig()
    unread = {"logit_mean": "logit_normal", "logit_std": "logit_normal", "mode_scale": "mode"}
    for key, density in unread.items():
        _require(f.sigma_density == density or getattr(f, key) == getattr(default, key),
                 f"model.flow.{key}={getattr(f, key)} is read only with model.flow.sigma_density={density}, and "
                 f"this run draws sigma by {f.sigma_density}, which would ignore it: remove the key")
    _require(m.min_snr_gamma is None or m.min_snr_gamma > 0,
             f"model.min_snr_gamma={m.min_snr_gamma} must be positive (5.0 in the paper), or null for uniform weights")
    _require(not m.min_snr_floor or m.min_snr_gamma is not None,
             f"model.min_snr_floor={m.min_snr_floor} is read only with model.min_snr_gamma set (it floors min-SNR's "
             f"weights), which would ignore it: set model.min_snr_gamma, or remove the key")


def _check_model(m: ModelConfig) -> None:
    from diffusion.models import denoisers, objectives
    if m.objective is not None and m.objective not in objectives.names():
        close = difflib.get_close_matches(m.objective, objectives.names(), n=1)
        raise ConfigError(f"model.objective={m.objective!r} is not one of {', '.join(objectives.names())}"
                          + (f" (did you mean {close[0]!r}?)" if close else ""))
    if m.denoiser != "auto" and m.denoiser not in denoisers.names():
        raise ConfigError(f"model.denoiser={m.denoiser!r}: no adapter for it; choose auto or one of "
                          f"{', '.join(denoisers.names())}")
    if m.objective and m.prediction_type and m.objective != m.prediction_type:
        raise ConfigError(f"model.objective={m.objective} and model.prediction_type={m.prediction_type} disagree: "
                          f"give one")
    trains = m.objective or m.prediction_type
    if m.zero_terminal_snr and trains not in (None, "v_prediction"):
        raise ConfigError(f"model.zero_terminal_snr needs v-prediction, not {trains} (epsilon is undefined at the "
                          f"terminal step): set model.prediction_type=v_prediction")
    if trains:  # a key only another objective reads (model.min_snr_gamma under flow ...) is refused, not ignored
        objectives.check_keys(trains, m)  # (trains null: the reference's scheduler decides, at build_model)
    _check_unread_settings(m)
    _require(m.min_snr_floor >= 0, f"model.min_snr_floor={m.min_snr_floor} must be >= 0")
    if m.zero_terminal_snr and m.min_snr_gamma and not m.min_snr_floor:
        print("note: model.min_snr_gamma with model.zero_terminal_snr gives the terminal step (SNR = 0) loss "
              "weight 0, so the step zero terminal SNR adds is not trained; set model.min_snr_floor (e.g. 0.1) "
              "to keep it", flush=True)
    _require(m.eval_bins >= 0, f"model.eval_bins={m.eval_bins} must be >= 0 (0: off)")
    _require(m.eval_protocol == "mlperf" or m.eval_bins > 0,
             f"model.eval_protocol={m.eval_protocol} is read only with model.eval_bins > 0 (the binned held-out loss)")
    _require(0.0 <= m.masking.ratio < 1.0, f"model.masking.ratio={m.masking.ratio} must be in [0, 1) (0: no masking)")
    _require(m.masking.mixer_blocks >= 1, f"model.masking.mixer_blocks={m.masking.mixer_blocks} must be at least 1")
    _require(0.0 <= m.routing.ratio < 1.0, f"model.routing.ratio={m.routing.ratio} must be in [0, 1) (0: no routing)")
    _require(not (m.routing.ratio and m.masking.ratio), f"model.routing.ratio={m.routing.ratio} and "
             f"model.masking.ratio={m.masking.ratio}: a step either masks patches or routes tokens; set one to 0")
    _require(m.routing.start >= 0, f"model.routing.start={m.routing.start} must be at least 0")
    if m.repa is not None:
        r = m.repa
        _require(bool(r.encoder), "model.repa.encoder is empty: give a vision encoder (hub id or local directory), "
                                  "e.g. facebook/dinov2-base")
        _require(r.block >= 1, f"model.repa.block={r.block} must be at least 1 (the first block's output)")
        _require(r.weight > 0, f"model.repa.weight={r.weight} must be positive (model.repa=null: off)")
        _require(r.until is None or r.until >= 0, f"model.repa.until={r.until} must be >= 0 (null: never off)")
        _require(r.projector_dim >= 1, f"model.repa.projector_dim={r.projector_dim} must be positive")
    f = m.flow
    _require(f.shift > 0, f"model.flow.shift={f.shift} must be positive")
    _require(f.logit_std > 0, f"model.flow.logit_std={f.logit_std} must be positive")
    _require(f.num_train_timesteps > 0, f"model.flow.num_train_timesteps={f.num_train_timesteps} must be positive")
    _require(f.shift_base_resolution is None or f.shift_base_resolution > 0,
             f"model.flow.shift_base_resolution={f.shift_base_resolution} must be positive (or null)")


def _check_consistency(cfg: Config) -> None:
    m, t, o = cfg.model, cfg.trainer, cfg.optimizer
    if m.resolution % 8:
        raise ConfigError(f"model.resolution={m.resolution} is not a multiple of 8 (the VAE downsampling)")
    if not 0 <= t.seed < 2 ** 32:  # numpy's range, which Composer seeds too
        raise ConfigError(f"trainer.seed={t.seed} must be a whole number from 0 to 2**32 - 1")
    _check_model(m)
    if cfg.data.eval is not None and cfg.data.eval.source != "mds":
        raise ConfigError("data.eval.source must be mds: the held-out set is read from stored shards")
    for name, loader in (("train", cfg.data.train), ("eval", cfg.data.eval)):
        if loader is None:
            continue
        _check_streams(name, loader)
        if not 0.0 <= loader.caption_dropout < 1.0:
            raise ConfigError(f"data.{name}.caption_dropout={loader.caption_dropout} must be in [0, 1)")
        if loader.shuffle_seed < 0:  # streaming refused it with a traceback when the loader was built
            raise ConfigError(f"data.{name}.shuffle_seed={loader.shuffle_seed} must be a whole number >= 0")
        if loader.captions is not None:
            from diffusion.loader.captions import CaptionChoice
            try:
                CaptionChoice.from_mapping(loader.captions, where=f"data.{name}.captions")
            except ValueError as e:
                raise ConfigError(str(e)) from None
            _require(loader.source == "mds", f"data.{name}.captions: several captions are read from stored "
                                             f"shards (data.{name}.source: mds)")
        _require(loader.batch_size > 0, f"data.{name}.batch_size={loader.batch_size} must be a positive number "
                                        f"of samples (the global batch, split across ranks)")
        _require(loader.num_workers >= 0, f"data.{name}.num_workers={loader.num_workers} must be 0 (load in the "
                                          f"training process) or more")
        _require(loader.prefetch_factor is None or loader.prefetch_factor > 0,
                 f"data.{name}.prefetch_factor={loader.prefetch_factor} must be positive (or null)")
        _require(loader.num_samples is None or loader.num_samples >= loader.batch_size,
                 f"data.{name}.num_samples={loader.num_samples} is less than one batch "
                 f"(data.{name}.batch_size={loader.batch_size}): no full batch could ever be made")
        _require(loader.download_timeout > 0, f"data.{name}.download_timeout={loader.download_timeout} must be "
                                              f"positive (seconds)")
    _require(math.isfinite(o.lr) and o.lr >= 0, f"optimizer.lr={o.lr} must be a finite number >= 0")
    _require(math.isfinite(o.weight_decay) and o.weight_decay >= 0,
             f"optimizer.weight_decay={o.weight_decay} must be a finite number >= 0")
    if o.betas is None:  # each optimizer's reference: AdamW's own, Muon's AdamW fallback KellerJordan's
        o.betas = [0.9, 0.95] if o.name == "muon" else [0.9, 0.999]
    _require(math.isfinite(o.ns_eps) and o.ns_eps > 0, f"optimizer.ns_eps={o.ns_eps} must be a small positive number")
    _require(len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas),
             f"optimizer.betas={o.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    _require(math.isfinite(o.eps) and o.eps > 0, f"optimizer.eps={o.eps} must be a small positive number")
    _require(0.0 <= o.momentum < 1.0, f"optimizer.momentum={o.momentum} must be in [0, 1)")
    # a key only the other optimizer reads is refused, not ignored (issue 47 item 7)
    unread = ("momentum", "nesterov", "ns_coefficients", "ns_eps") if o.name != "muon" else ("fused",)
    for key in unread:
        value = getattr(o, key)
        _require(value == getattr(OptimizerConfig(), key),
                 f"optimizer.{key}={value!r} is read only by optimizer.name={'adamw' if key == 'fused' else 'muon'}, "
                 f"and this run trains {o.name}, which would ignore it: remove the key")
    _require(o.name != "muon" or t.fsdp is None or (t.fsdp.version == 1 and t.fsdp.sharding_strategy == "NO_SHARD"),
             f"optimizer.name=muon needs whole weight matrices, which FSDP shards (trainer.fsdp.version="
             f"{t.fsdp.version if t.fsdp else None}, sharding_strategy={t.fsdp.sharding_strategy if t.fsdp else None}): "
             f"train with DDP (trainer.fsdp=null) or trainer.fsdp.sharding_strategy=NO_SHARD")
    _require(0.0 <= cfg.scheduler.alpha_f <= 1.0, f"scheduler.alpha_f={cfg.scheduler.alpha_f} must be in [0, 1] "
                                                  f"(the final learning-rate multiplier)")
    _check_duration("scheduler.t_warmup", cfg.scheduler.t_warmup, positive=False)
    _require(t.grad_clip_norm is None or t.grad_clip_norm >= 0,
             f"trainer.grad_clip_norm={t.grad_clip_norm} must be a positive norm (null or 0 turns clipping off)")
    if isinstance(t.device_train_microbatch_size, int) and t.device_train_microbatch_size <= 0:
        raise ConfigError("trainer.device_train_microbatch_size must be positive or 'auto'")
    _require(t.grad_norm_log_interval >= 1, f"trainer.grad_norm_log_interval={t.grad_norm_log_interval} must be >= 1")
    _require(not (t.compile and t.device_train_microbatch_size == "auto"),
             "trainer.compile=true with trainer.device_train_microbatch_size=auto: each size the search tries "
             "compiles the model again; give a number of samples per microbatch")
    if t.fsdp is not None and t.fsdp.version == 2:
        if t.fsdp.sharding_strategy == "NO_SHARD":
            raise ConfigError(f"trainer.fsdp.sharding_strategy={t.fsdp.sharding_strategy} has no FSDP2 equivalent "
                              f"here: use FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or _HYBRID_SHARD_ZERO2, or "
                              f"trainer.fsdp.version=1")
        if t.device_train_microbatch_size == "auto":
            raise ConfigError("trainer.device_train_microbatch_size=auto fails under FSDP2 in Composer 0.32: give "
                              "a number of samples, or use trainer.fsdp.version=1")
    if t.fsdp is not None:
        f = t.fsdp
        _require(f.data_parallel_shard_degree == -1 or f.data_parallel_shard_degree >= 1,
                 f"trainer.fsdp.data_parallel_shard_degree={f.data_parallel_shard_degree} must be a number of ranks "
                 f"(or -1: the rest of the world size)")
        _require(f.data_parallel_replicate_degree in (None, -1) or f.data_parallel_replicate_degree >= 1,
                 f"trainer.fsdp.data_parallel_replicate_degree={f.data_parallel_replicate_degree} must be a number "
                 f"of replicas (or null: the rest of the world size)")
        _require(f.sharding_strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") or
                 f.data_parallel_replicate_degree is None,
                 f"trainer.fsdp.data_parallel_replicate_degree={f.data_parallel_replicate_degree} needs "
                 f"trainer.fsdp.sharding_strategy=HYBRID_SHARD (or _HYBRID_SHARD_ZERO2); "
                 f"{f.sharding_strategy} shards over every rank")
    if t.fsdp is not None and t.fsdp.state_dict_type == "sharded" and "ema" in cfg.algorithms and t.fsdp.version == 1:
        raise ConfigError("trainer.fsdp.state_dict_type=sharded with algorithms.ema needs trainer.fsdp.version=2 "
                          "(under FSDP1 the EMA is checkpointed as full tensors only): use trainer.fsdp.version=2, "
                          "or trainer.fsdp.state_dict_type=full")
    if t.fsdp is not None and t.fsdp.state_dict_type == "sharded" and "posthoc_ema" in cfg.algorithms \
            and t.fsdp.version == 1:
        raise ConfigError("trainer.fsdp.state_dict_type=sharded with algorithms.posthoc_ema needs "
                          "trainer.fsdp.version=2 (under FSDP1 its averages are checkpointed as full tensors only): "
                          "use trainer.fsdp.version=2, or trainer.fsdp.state_dict_type=full")
    for key in ("max_duration", "eval_interval", "save_interval"):  # the run's length is no fraction of itself
        _check_duration(f"trainer.{key}", getattr(t, key), fraction=key != "max_duration")
