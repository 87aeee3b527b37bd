"""Post-hoc EMA (Karras et al. 2024, EDM2): choose the averaging length after training, not before.

Training keeps a few *power-function* averages of the trainable weights, each named by its relative
width ``sigma_rel``, and writes each of them to a snapshot file every ``snapshot_every`` batches. After
training, ``python -m diffusion.posthoc_ema --run SAVE_FOLDER --sigma-rel 0.08 --out CKPT`` combines
the snapshots into the average of any ``sigma_rel`` and writes a checkpoint generate and export read.

The average after ``t`` updates weights the weights of update ``i`` by the integral of
``(gamma + 1) tau^gamma / t^(gamma + 1)`` over ``[i - 1, i]``: a profile over the whole run so far that
grows as a power of time, so its width stays a fixed fraction of the run's length however long it gets
(a fixed decay's average spans a fixed number of batches instead). As an update:

    avg_t = beta_t * avg_{t-1} + (1 - beta_t) * weights_t      beta_t = (1 - 1/t)^(gamma + 1)

(``beta_1 = 0``: the first update copies the weights). ``sigma_rel`` is the profile's standard deviation
over the run's length, ``sqrt((gamma + 1) / ((gamma + 2)^2 (gamma + 3)))``; :func:`gamma_of` inverts it.
EDM2's sweet spots lie around 0.05-0.15; 0.2887 (gamma = 0) is the plain mean of every weight so far.

Synthesis. Each snapshot is a profile ``p_(gamma, t)`` over training time; any other profile
``p_(gamma_r, t_r)`` is approximated by the combination ``sum_i x_i p_i`` closest to it in L2 over time:
``A x = b`` with ``A_ij = <p_i, p_j>`` and ``b_i = <p_i, p_r>`` (inner products in closed form,
:func:`_inner`), solved by least squares and divided by its sum (EDM2's normalisation: an average's
coefficients sum to 1); the average is the same combination of the snapshots' weights. A tracked
profile's own ``sigma_rel`` at a snapshot's time is reproduced (its snapshot is in the span); others
come out as close as two tracked widths and the snapshots' spacing allow, and the command prints the
residual so a width out of reach is visible.

State: each profile is an :class:`~diffusion.train.algorithms.ema.EMA` whose decay is ``beta_t``: the
same shard-local fused update, FSDP gather for snapshots (FSDP1 with full state dicts through
``summon_full_params``, FSDP2 through ``full_tensor``) and exact checkpoint/resume of its average and
update count (Composer stores it under ``state["algorithms"]`` as ``PostHocEMA``). With FSDP2 sharded
checkpoints each profile's shards are written by every rank beside the weights', as the EMA's
(:class:`~diffusion.train.algorithms.ema.EMAShards`, group ``PostHocEMA-<width>``); FSDP1 with sharded
checkpoints is refused at fit start, as for the EMA. Snapshots are written by global rank 0 into
``trainer.save_folder/posthoc/ema-<sigma_rel>-ba<batch>.safetensors`` (weights only, float32, with
``sigma_rel``, ``gamma``, ``t``, ``batch`` and the run's identity as its checkpoints record it in the
file's metadata), atomically; a resumed run rewrites a snapshot the killed run wrote after its checkpoint
with the same weights. A remote save folder needs ``algorithms.posthoc_ema.folder`` (a local folder)
instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np
import torch
from composer.core import Algorithm, Event, State, Time, TimeUnit
from composer.loggers import Logger

from diffusion.errors import ConfigError
from diffusion.train.algorithms.ema import EMA, _uses_fsdp1

SNAPSHOT_DIR = "posthoc"
SNAPSHOT_SUFFIX = ".safetensors"
_SNAPSHOT = re.compile(r"^ema-(\d+(?:\.\d+)?)-ba(\d+)\.safetensors$")
_UMASK = os.umask(0o022)
os.umask(_UMASK)
UNIFORM_SIGMA_REL = 12 ** -0.5  # gamma = 0: every weight so far counts the same; wider is not a power profile


def sigma_rel_of(gamma: float) -> float:
    """The relative standard deviation of the power profile of exponent ``gamma``."""
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def gamma_of(sigma_rel: float) -> float:
    """The exponent whose profile has relative width ``sigma_rel`` (0 < sigma_rel < 0.2887)."""
    if isinstance(sigma_rel, bool) or not isinstance(sigma_rel, (int, float)) or not 0 < sigma_rel < UNIFORM_SIGMA_REL:
        raise ValueError(f"sigma_rel {sigma_rel!r} must be a number in (0, {UNIFORM_SIGMA_REL:.4f}): a fraction of "
                         f"the run's length, e.g. 0.05 or 0.10 (EDM2's range)")
    # (gamma + 2)^2 (gamma + 3) = (gamma + 1) / sigma_rel^2, a cubic with one root above 0 here
    s = sigma_rel ** -2
    roots = np.roots([1.0, 7.0, 16.0 - s, 12.0 - s])
    return float(max(r.real for r in roots if abs(r.imag) < 1e-7 * max(1.0, abs(r.real))))


def _inner(gamma_a: float, t_a: float, gamma_b: float, t_b: float) -> float:
    """``<p_a, p_b>`` = the integral over time of the product of two power profiles."""
    m = min(t_a, t_b)
    log = (gamma_a + gamma_b + 1) * math.log(m) - (gamma_a + 1) * math.log(t_a) - (gamma_b + 1) * math.log(t_b)
    return (gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1) * math.exp(log)


def synthesis_weights(snapshots: list[tuple[float, float]], gamma: float, t: float) -> tuple[np.ndarray, float]:
    """The coefficients of each snapshot ``(gamma_i, t_i)`` whose combination is closest to the profile
    ``(gamma, t)``, and the relative L2 error of that combination (0: exact)."""
    scale = max(t, *(ti for _, ti in snapshots))  # times as fractions of the last: no overflow in t^gamma
    points = [(g, ti / scale) for g, ti in snapshots]
    target = (gamma, t / scale)
    a = np.array([[_inner(*p, *q) for q in points] for p in points])
    b = np.array([_inner(*p, *target) for p in points])
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    # An average's coefficients sum to 1 (EDM2's solve_posthoc_coefficients divides by the sum): the raw
    # least-squares solution would scale every weight, norm gains and biases included, by its sum.
    x = x / x.sum()
    norm = _inner(*target, *target)
    error = max(float(x @ a @ x - 2 * x @ b + norm), 0.0)
    return x, math.sqrt(error / norm)


@dataclasses.dataclass
class Snapshot:
    path: str
    sigma_rel: float
    gamma: float
    t: int  # updates of the profile when it was written: its time in the synthesis
    batch: int
    run: dict | None = None  # the model's description and the run's data, as checkpoints record them


def run_identity(model) -> dict | None:
    """What the run's checkpoints say it is (the model extra state's description and run data, without
    the phase), for a snapshot's metadata; None for a model that does not describe itself."""
    while hasattr(model, "module") and not hasattr(model, "get_extra_state"):
        model = model.module  # DistributedDataParallel keeps the ComposerModel in .module
    try:
        extra = model.get_extra_state()
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(extra, dict) or not isinstance(extra.get("description"), dict):
        return None
    return {k: extra[k] for k in ("description", "run") if k in extra}


def width_label(sigma_rel: float) -> str:
    """``sigma_rel`` as a snapshot's name writes it: three decimals ("0.050"), or every digit the width
    needs when three would round it ("0.1004"), so two widths never share a file."""
    short = f"{sigma_rel:.3f}"
    return short if float(short) == sigma_rel else np.format_float_positional(sigma_rel, trim="-")


def snapshot_name(sigma_rel: float, batch: int) -> str:
    return f"ema-{width_label(sigma_rel)}-ba{batch}{SNAPSHOT_SUFFIX}"


def read_snapshots(folder: str) -> list[Snapshot]:
    """The snapshots in ``folder`` (a run's ``posthoc/``), by batch then width; metadata only."""
    from diffusion.errors import InputError
    found = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not _SNAPSHOT.match(name):
            continue
        path = os.path.join(folder, name)
        with open_snapshot(path) as f:
            meta = f.metadata() or {}
        try:
            run = json.loads(meta["run"]) if "run" in meta else None
            found.append(Snapshot(path, float(meta["sigma_rel"]), float(meta["gamma"]), int(meta["t"]),
                                  int(meta["batch"]), run if isinstance(run, dict) else None))
        except (KeyError, ValueError):
            raise InputError(f"{path}: not a post-hoc EMA snapshot (its metadata lacks sigma_rel, gamma, t, "
                             f"batch)") from None
    return sorted(found, key=lambda s: (s.batch, s.sigma_rel))


def open_snapshot(path: str):
    """``safetensors.safe_open`` of a snapshot; a file it cannot read (a cut or oversized header, not
    safetensors at all) is one :class:`~diffusion.errors.InputError` naming it."""
    from safetensors import SafetensorError, safe_open

    from diffusion.errors import InputError
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{path}: not a readable safetensors snapshot ({reason}): cut short by a full disk or a "
                         f"killed copy? Remove it, or copy it again") from None


def write_snapshot(folder: str, snapshot: Snapshot, params: dict[str, torch.Tensor]) -> str:
    """Write ``params`` (full tensors) as ``snapshot`` into ``folder`` atomically; returns the path."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, snapshot_name(snapshot.sigma_rel, snapshot.batch))
    partial = os.path.join(folder, ".partial-" + os.path.basename(path))
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in params.items()}
    metadata = {"sigma_rel": repr(snapshot.sigma_rel), "gamma": repr(snapshot.gamma), "t": str(snapshot.t),
                "batch": str(snapshot.batch)}
    if snapshot.run is not None:
        metadata["run"] = json.dumps(snapshot.run, sort_keys=True, default=str)
    save_file(tensors, partial, metadata=metadata)
    os.chmod(partial, 0o666 & ~_UMASK)  # safetensors writes 0600; readable as the checkpoints beside it are
    os.replace(partial, path)
    return path


class PowerEMA(EMA):
    """One tracked profile: the EMA's machinery with the power function's ``beta_t`` as its decay."""

    def __init__(self, sigma_rel: float):
        super().__init__(smoothing=0.0, warmup=False)
        self.sigma_rel = float(sigma_rel)
        self.gamma = gamma_of(self.sigma_rel)

    def __repr__(self) -> str:
        return f"PowerEMA(sigma_rel={self.sigma_rel}, gamma={self.gamma:.4f})"

    @property
    def decay(self) -> float:
        t = self.num_updates + 1
        return (1.0 - 1.0 / t) ** (self.gamma + 1.0)


def _every(snapshot_every: str | int) -> int:
    try:
        time = (Time(snapshot_every, TimeUnit.BATCH) if isinstance(snapshot_every, int)
                else Time.from_timestring(str(snapshot_every)))
    except ValueError:
        time = None
    if time is None or time.unit != TimeUnit.BATCH or time.value < 1:
        raise ConfigError(f"algorithms.posthoc_ema.snapshot_every={snapshot_every!r}: give a positive batch count "
                          f"('500ba')")
    return int(time.value)


class PostHocEMA(Algorithm):
    """Power-function averages of the trainable weights and their snapshots (see the module docstring).

    Args:
        sigma_rels: the tracked profiles' relative widths (EDM2 tracks 0.05 and 0.10).
        snapshot_every: write every profile to a snapshot every this many batches ("500ba"), and at
            fit end.
        folder: where snapshots go (default: ``trainer.save_folder``/posthoc).
    """

    def __init__(self, sigma_rels: list[float] | tuple[float, ...] = (0.05, 0.10), snapshot_every: str | int = "500ba",
                 folder: str | None = None):
        key = "algorithms.posthoc_ema.sigma_rels"
        if not isinstance(sigma_rels, (list, tuple)) or not sigma_rels:
            raise ConfigError(f"{key}={sigma_rels!r}: give a list of widths, e.g. [0.05, 0.10]")
        try:
            self.profiles = [PowerEMA(s) for s in sigma_rels]
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
        if len({p.sigma_rel for p in self.profiles}) != len(self.profiles):
            raise ConfigError(f"{key}={list(sigma_rels)} names a width twice")
        self.snapshot_every = _every(snapshot_every)
        self.folder = folder
        self._folder: str | None = None
        self._run: dict | None = None
        self.written: list[str] = []  # snapshot paths this process wrote (rank 0)

    def __repr__(self) -> str:
        return (f"PostHocEMA(sigma_rels={[p.sigma_rel for p in self.profiles]}, "
                f"snapshot_every={self.snapshot_every}ba)")

    def shard_groups(self) -> dict[str, EMA]:
        """Each profile by the group its shards take in FSDP2 sharded checkpoints (``EMAShards``)."""
        return {f"PostHocEMA-{width_label(p.sigma_rel).replace('.', '_')}": p for p in self.profiles}

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.FIT_START, Event.BATCH_END, Event.FIT_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        sharded = bool(getattr(state, "fsdp_sharded_state_dict_enabled", False))
        for profile in self.profiles:
            profile._bind(state.model, sharded=sharded)
        batch = int(state.timestamp.batch)
        if event == Event.FIT_START:
            if sharded and _uses_fsdp1(state.model):
                raise ConfigError("algorithms.posthoc_ema with FSDP1 sharded checkpoints is not supported: use "
                                  "trainer.fsdp.state_dict_type=full, or FSDP2")
            self._folder = self._snapshot_folder(state)
            self._run = run_identity(state.model)
            for profile in self.profiles:
                if not profile.started:
                    profile._start_now(batch)
        elif event == Event.BATCH_END:
            for profile in self.profiles:
                profile.update()
            if batch % self.snapshot_every == 0:
                self.snapshot(batch)
        elif batch % self.snapshot_every != 0 and self.profiles[0].num_updates > 0:  # FIT_END off the grid
            self.snapshot(batch)

    def _snapshot_folder(self, state: State) -> str:
        if self.folder:
            if "://" in self.folder:
                raise ConfigError(f"algorithms.posthoc_ema.folder={self.folder}: give a local folder (the "
                                  f"synthesis reads the snapshots as files)")
            return os.path.expanduser(self.folder)
        from composer.callbacks import CheckpointSaver
        from composer.utils import format_name_with_dist
        savers = [c for c in state.callbacks if isinstance(c, CheckpointSaver)]
        if not savers:
            raise ConfigError("algorithms.posthoc_ema writes its snapshots into trainer.save_folder/posthoc: set "
                              "trainer.save_folder (or algorithms.posthoc_ema.folder)")
        if savers[0].remote_uploader is not None:
            raise ConfigError("algorithms.posthoc_ema with a remote trainer.save_folder: give "
                              "algorithms.posthoc_ema.folder=LOCAL_DIR for the snapshots")
        return os.path.join(format_name_with_dist(savers[0].folder, state.run_name), SNAPSHOT_DIR)

    @torch.no_grad()
    def snapshot(self, batch: int) -> None:
        """Every profile to its snapshot file (a collective under FSDP: every rank calls it; rank 0 writes)."""
        from composer.utils import dist
        for profile in self.profiles:
            params = profile._ema_params(every_rank=False)  # rank 0 writes: the others let each tensor go
            if dist.get_global_rank() == 0:
                meta = Snapshot("", profile.sigma_rel, profile.gamma, profile.num_updates, batch, self._run)
                self.written.append(write_snapshot(self._folder, meta, params))

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["profiles"] = [dict(p.state_dict(), sigma_rel=p.sigma_rel, gamma=p.gamma) for p in self.profiles]
        state["snapshot_every"] = self.snapshot_every
        return state

    def load_state_dict(self, state: dict, strict: bool = False) -> None:
        saved = {float(p["sigma_rel"]): p for p in state.get("profiles") or []}
        wanted = [p.sigma_rel for p in self.profiles]
        if sorted(saved) != sorted(wanted):
            raise ConfigError(f"algorithms.posthoc_ema.sigma_rels={wanted}, but the checkpoint tracks {sorted(saved)}: "
                              f"a resumed run keeps its profiles (start a new save folder to change them)")
        for profile in self.profiles:
            profile.load_state_dict(saved[profile.sigma_rel])
