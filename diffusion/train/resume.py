"""Autoresume continues only the run that wrote the checkpoint.

A save folder is a run's identity: ``trainer.autoresume`` loads whatever ``latest-rank0.pt`` points to. A
second command that trains another model into the same folder (another model reference, denoiser,
objective, text encoder or dataset) would otherwise load the first run's weights into its own, train
them on its data, move ``latest`` and, at the next save, prune the first run's checkpoints.

Before Composer loads anything, :func:`check_own_run` reads what the checkpoint says it is (the model's
extra state: its :class:`~diffusion.models.description.ModelDescription` and the run's data, read
weights-only: a monolithic file memory-mapped, a sharded folder's few non-tensor entries) and refuses, in
one line naming the folder and the first difference, a checkpoint of another run. Checkpoints written
before the run's data was recorded are compared on the model alone.
"""

from __future__ import annotations

import json
import os

from diffusion.errors import ConfigError
from diffusion.models import safe_checkpoint

EXTRA_STATE = "state.model._extra_state."  # a sharded checkpoint's flattened names of the model's extra state


def data_identity(cfg) -> str | None:
    """The run's training data as checkpoints record it: its dataset path(s), local ones absolute
    (None for online mode's stream, whose input is not a dataset)."""
    train = cfg.data.train
    if getattr(train, "source", "mds") != "mds":
        return None
    paths = [s.path for s in train.streams] if train.streams else [train.path]
    return " + ".join(p if "://" in str(p) else os.path.abspath(os.path.expanduser(str(p))) for p in paths if p)


def extra_state_of(path: str) -> dict | None:
    """The model extra state of the checkpoint at ``path`` (a file, or a sharded checkpoint's folder),
    read without running code from it; None if it holds none."""
    if os.path.isdir(path):
        entries = safe_checkpoint.read_entries(path, EXTRA_STATE)
        out: dict = {}
        for name, value in entries.items():
            node, parts = out, name[len(EXTRA_STATE):].split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        return out or None
    state = safe_checkpoint.load(path, mmap=True).get("state") or {}
    extra = (state.get("model") or {}).get("_extra_state")
    return extra if isinstance(extra, dict) else None


def _plain(value):
    """Tuples as lists, for comparing a config read back with one built here."""
    return json.loads(json.dumps(value, default=str))


def _ref(ref) -> str:
    ref = str(ref)
    return os.path.normpath(ref) if os.path.isabs(ref) else ref


def differences(saved: dict, model, data: str | None, text_encoder: str | None) -> list[str]:
    """What the checkpoint's extra state ``saved`` says it is and this run is not, one phrase each."""
    from diffusion.models.description import ModelDescription
    try:
        was = ModelDescription.from_extra_state(saved)
    except (KeyError, TypeError):
        return ["it holds no model description"]
    now = model.description
    found = []

    def differ(what, theirs, ours):
        if _plain(theirs) != _plain(ours):
            found.append(f"its {what} is {theirs!r}, this run's {ours!r}")

    differ("model.ref", _ref(was.model_ref), _ref(now.model_ref))
    differ("denoiser", was.denoiser, now.denoiser)
    if was.denoiser == now.denoiser:
        keys = sorted(k for k in set(was.denoiser_config) | set(now.denoiser_config) if not k.startswith("_")
                      and _plain(was.denoiser_config.get(k)) != _plain(now.denoiser_config.get(k)))
        for key in keys[:3]:
            differ(f"denoiser's {key}", was.denoiser_config.get(key), now.denoiser_config.get(key))
    differ("objective", was.objective, now.objective)
    differ("text width", was.text_dim, now.text_dim)
    differ("text length", was.text_length, now.text_length)
    differ("model.text_mask", was.text_mask, now.text_mask)
    if was.latent_space is not None and now.latent_space is not None:
        differ("latent space", was.latent_space, now.latent_space)
    differ("model.resolution", was.resolution, now.resolution)
    run = saved.get("run") if isinstance(saved.get("run"), dict) else {}
    if run.get("data") is not None and data is not None:
        differ("training data", run["data"], data)
    if "text_encoder" in run:
        differ("text encoder", run.get("text_encoder"), text_encoder)
    return found


def check_own_run(path: str, shown_folder: str, model, data: str | None, text_encoder: str | None) -> None:
    """Refuse (:class:`~diffusion.errors.ConfigError`, one line) to autoresume from the checkpoint at
    ``path`` in ``shown_folder`` (``trainer.save_folder`` as given) if another run wrote it."""
    saved = extra_state_of(path)
    if saved is None:
        return  # Composer's own format without our model: its load says what it holds
    check_own_state(saved, os.path.basename(os.path.normpath(os.path.realpath(path))), shown_folder, model, data,
                    text_encoder)


def check_own_state(saved: dict, name: str, shown_folder: str, model, data: str | None, text_encoder: str | None,
                    loaded: bool = False) -> None:
    """:func:`check_own_run` on the checkpoint ``name``'s extra state ``saved``; ``loaded``: read as Composer
    loaded it (a remote sharded checkpoint, read in place), nothing trained yet."""
    found = differences(saved, model, data, text_encoder)
    if not found:
        return
    more = f" (and {len(found) - 1} more difference{'s' if len(found) > 2 else ''})" if len(found) > 1 else ""
    done = "its weights were loaded and nothing was trained" if loaded else "nothing was loaded or trained"
    raise ConfigError(f"trainer.save_folder={shown_folder} holds another run's checkpoint ({name}): {found[0]}{more}; "
                      f"autoresume continues only the run that wrote it, so {done}: give this "
                      f"run its own trainer.save_folder (to start from those weights, also "
                      f"trainer.load_path={shown_folder.rstrip('/')}/{name})")
