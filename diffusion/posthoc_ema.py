"""``python -m diffusion.posthoc_ema``: the post-hoc EMA of any width from a run's snapshots, as a checkpoint.

    python -m diffusion.posthoc_ema --run out/mmdit/checkpoints --sigma-rel 0.08 --out ema-0.08.pt
    python -m diffusion.generate --checkpoint ema-0.08.pt --prompt "a red circle"
    python -m diffusion.export --checkpoint ema-0.08.pt --out exported/

A run trained with ``algorithms.posthoc_ema`` holds snapshots of its power-function averages in
``SAVE_FOLDER/posthoc/`` (:mod:`diffusion.train.algorithms.posthoc_ema`). This combines them into the
average of ``--sigma-rel`` at the last snapshot's batch (or ``--batch``), by EDM2's least squares, and
writes a checkpoint holding the run's model (its description and frozen weights, from
``SAVE_FOLDER/latest-rank0.pt`` or ``--checkpoint``) and the synthesised average as its EMA: what
generate, export, evaluate and ``algorithms.ema.init_from`` read. Reading one tensor of every
snapshot at a time, it holds one copy of the weights in memory.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os

import torch

from diffusion import cli
from diffusion.errors import InputError, UserError
from diffusion.train.algorithms import posthoc_ema as phe
from diffusion.train.save_folder import CHECKPOINT_FILE, LATEST

RESIDUAL_NOTE = 0.05  # a relative L2 error of the profile above this is worth a line


def find_snapshots(run: str) -> list[phe.Snapshot]:
    """The snapshots of the run in save folder ``run`` (its ``posthoc/``, or ``run`` itself)."""
    if os.path.exists(run) and not os.path.isdir(run):
        raise UserError(f"--run {run} is a file: give the run's trainer.save_folder")
    if not os.path.isdir(run):
        raise FileNotFoundError(2, "no such save folder", run)
    for folder in (os.path.join(run, phe.SNAPSHOT_DIR), run):
        found = phe.read_snapshots(folder)
        if found:
            return found
    raise InputError(f"{run}: no post-hoc EMA snapshots ({phe.SNAPSHOT_DIR}/ema-*.safetensors): train with "
                     f"algorithms.posthoc_ema to write them")


def synthesise(snapshots: list[phe.Snapshot], sigma_rel: float, batch: int | None = None):
    """``(params, info)``: the average of width ``sigma_rel`` at ``batch`` (default: the last snapshot's)
    from ``snapshots`` (those at or before ``batch``), and what it used (coefficients, residual)."""
    try:
        gamma = phe.gamma_of(sigma_rel)
    except ValueError as e:
        raise UserError(f"--sigma-rel: {e}") from None
    batch = max(s.batch for s in snapshots) if batch is None else batch
    used = [s for s in snapshots if s.batch <= batch]
    at = [s for s in used if s.batch == batch]
    if not at:
        batches = sorted({s.batch for s in snapshots})
        raise UserError(f"--batch {batch}: no snapshot at that batch; the run has snapshots at {batches[:8]}"
                        + (" ..." if len(batches) > 8 else ""))
    _check_one_run(used)
    t = at[0].t  # the profiles' time at that batch (updates since they started)
    weights, residual = phe.synthesis_weights([(s.gamma, s.t) for s in used], gamma, t)
    params = _combine(used, weights)
    info = {"sigma_rel": float(sigma_rel), "gamma": gamma, "batch": int(batch), "t": int(t), "residual": residual,
            "snapshots": [os.path.basename(s.path) for s in used], "coefficients": [float(w) for w in weights]}
    return params, info


def _differences(saved: dict, run: dict, ours: str = "the snapshots'") -> list[str]:
    """What the identity ``saved`` (a checkpoint's model extra state, or a snapshot's run) says it is and
    the snapshots' ``run`` is not, one phrase each (autoresume's own-run comparison), ``run`` called ``ours``."""
    import types

    from diffusion.models.description import ModelDescription
    from diffusion.train import resume
    try:
        model = types.SimpleNamespace(description=ModelDescription.from_extra_state(run))
    except (KeyError, TypeError):
        return []
    data = run.get("run") if isinstance(run.get("run"), dict) else {}
    found = resume.differences(saved, model, data.get("data"), data.get("text_encoder"))
    return [phrase.replace(", this run's ", f", {ours} ") for phrase in found]


def _shapes(snapshot: phe.Snapshot) -> dict[str, tuple]:
    """The snapshot's parameter names and shapes, from its header."""
    with phe.open_snapshot(snapshot.path) as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def _check_one_run(snapshots: list[phe.Snapshot]) -> None:
    """Refuse, in one line naming a file, snapshots that are not all one run's: another run's identity
    in their metadata, or other parameters or shapes (snapshots written before the identity was recorded)."""
    first = snapshots[0]
    known = next((s for s in reversed(snapshots) if s.run is not None), None)  # the latest's run
    for s in snapshots:
        if known is not None and s.run is not None and s.run != known.run:
            found = _differences(s.run, known.run, "that one's") or ["another model description or data"]
            raise InputError(f"{s.path}: a snapshot of another run than {os.path.basename(known.path)} "
                             f"({found[0]}): give --run the save folder of one run")
    shapes = _shapes(first)
    for s in snapshots[1:]:
        theirs = _shapes(s)
        if theirs == shapes:
            continue
        other = sorted(set(theirs) ^ set(shapes))
        if other:
            why = f"{other[0]} is in only one of them"
        else:
            name = next(n for n in sorted(shapes) if shapes[n] != theirs[n])
            why = f"its {name} is {list(theirs[name])}, there {list(shapes[name])}"
        raise InputError(f"{s.path}: holds other parameters than {os.path.basename(first.path)} ({why}): "
                         f"snapshots of two runs in one folder? Give --run the save folder of one run")


def _combine(snapshots: list[phe.Snapshot], weights) -> dict[str, torch.Tensor]:
    """``sum_i weights_i * snapshot_i``, tensor by tensor in float64 (the coefficients alternate in sign)."""
    with_weight = [(s, float(w)) for s, w in zip(snapshots, weights) if w != 0.0]
    handles = [(phe.open_snapshot(s.path), w, s.path) for s, w in with_weight]
    names = list(handles[0][0].keys())
    out = {}
    for name in names:
        total = None
        for handle, w, _ in handles:
            term = handle.get_tensor(name).double() * w
            total = term if total is None else total.add_(term)
        out[name] = total.float()
    return out


def write_checkpoint(run: str, out: str, sigma_rel: float, *, batch: int | None = None,
                     checkpoint: str | None = None) -> dict:
    """Synthesise ``sigma_rel`` from ``run``'s snapshots and write it as checkpoint ``out``; returns the info."""
    from diffusion.models.checkpoint import read_state
    snapshots = find_snapshots(run)
    base = checkpoint or os.path.join(run, LATEST)
    if not os.path.exists(base):
        raise InputError(f"{run}: no {LATEST} to take the model from: give --checkpoint (a checkpoint of the run)")
    if os.path.abspath(out) in {os.path.abspath(base), os.path.realpath(base)}:
        raise UserError(f"--out {out} is the run's own checkpoint: write the average to a new file")
    run_files = {os.path.realpath(s.path) for s in snapshots}  # a snapshot written over is gone for good
    run_files.update(os.path.realpath(os.path.join(run, name)) for name in os.listdir(run)
                     if CHECKPOINT_FILE.match(name) or name == LATEST)
    if os.path.realpath(out) in run_files:
        raise UserError(f"--out {out} is one of the run's own checkpoints or snapshots: write the average to a "
                        f"new file")
    if os.path.isdir(out):
        raise UserError(f"--out {out} is a folder: name the checkpoint file to write, e.g. "
                        f"{os.path.join(out, f'ema-{sigma_rel:g}.pt')}")
    blocked = cli.file_in_the_way(out)  # the folders --out needs are made: none may be a file
    if blocked:
        raise UserError(f"--out {out}: cannot make its folder, {blocked} is a file")
    model_state = read_state(base)["model"]
    extra, identity = model_state.get("_extra_state"), snapshots[-1].run
    found = _differences(extra, identity) if isinstance(extra, dict) and identity is not None else []
    if found:
        raise InputError(f"{base}: a checkpoint of another run than the snapshots ({found[0]}): give --checkpoint "
                         f"a checkpoint of the run that wrote them")
    shapes = _shapes(snapshots[-1])
    missing = [name for name in shapes if name not in model_state]
    if missing:
        raise InputError(f"{base}: has no parameter {missing[0]} of the snapshots: a checkpoint of another run?")
    other = [name for name in shapes if tuple(model_state[name].shape) != shapes[name]]
    if other:
        raise InputError(f"{base}: its {other[0]} is {list(model_state[other[0]].shape)}, the snapshots' "
                         f"{list(shapes[other[0]])}: a checkpoint of another model? Give --checkpoint a checkpoint "
                         f"of the run that wrote them")
    params, info = synthesise(snapshots, sigma_rel, batch)
    params = {name: p.to(model_state[name].dtype) for name, p in params.items()}
    state = {"model": model_state, "algorithms": [("EMA", {"ema_params": params, "posthoc_ema": info})]}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    partial = os.path.join(os.path.dirname(os.path.abspath(out)), ".partial-" + os.path.basename(out))
    try:
        with open(partial, "wb") as f:  # a Python file: a full disk is the OSError it is, not torch's RuntimeError
            torch.save({"state": state}, f)
        os.replace(partial, out)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(partial)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OSError(e.errno, f"{os.strerror(e.errno)}: the average was not written (its unfinished file is "
                                   f"removed); free space and re-run", out) from None
        raise
    return info


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m diffusion.posthoc_ema",
        description="Synthesise the post-hoc EMA of any relative width from a run's snapshots "
                    "(algorithms.posthoc_ema) and write it as a checkpoint generate and export read.",
        epilog="example:\n  python -m diffusion.posthoc_ema --run out/mmdit/checkpoints --sigma-rel 0.08 "
               "--out ema-0.08.pt", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, metavar="SAVE_FOLDER",
                        help="the run's trainer.save_folder (snapshots in its posthoc/)")
    parser.add_argument("--sigma-rel", required=True, type=float,
                        help="the average's width as a fraction of the run's length (EDM2: 0.05-0.15)")
    parser.add_argument("--out", required=True, metavar="CKPT", help="the checkpoint file to write")
    parser.add_argument("--batch", type=int, default=None,
                        help="the average at this snapshot's batch (default: the last snapshot's)")
    parser.add_argument("--checkpoint", default=None, metavar="CKPT",
                        help=f"the run's checkpoint to take the model from (default: SAVE_FOLDER/{LATEST})")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    info = write_checkpoint(args.run, args.out, args.sigma_rel, batch=args.batch, checkpoint=args.checkpoint)
    print(f"sigma_rel {info['sigma_rel']:g} (gamma {info['gamma']:.2f}) at batch {info['batch']} from "
          f"{len(info['snapshots'])} snapshots, profile error {100 * info['residual']:.2f}%: wrote {args.out}")
    if info["residual"] > RESIDUAL_NOTE:
        print(f"note: the tracked widths reach sigma_rel {info['sigma_rel']:g} only roughly; a width between "
              f"(or near) the tracked ones, or more snapshots, come closer")
    print(f"sample it with python -m diffusion.generate --checkpoint {args.out}")


if __name__ == "__main__":
    cli.run(main, "posthoc_ema")
