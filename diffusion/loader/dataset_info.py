"""What a loader section's datasets record beside their shards, read and checked before any shard is.

``data.train`` (or ``data.eval``) names one dataset (``path``) or a weighted mix (``data.train.streams``).
Each dataset's ``dataset.json`` (:class:`~diffusion.schema.DatasetInfo`) and ``empty_text_embeds.npy``
are fetched (from object storage where the dataset is remote) and checked against the model and
against each other: every stream of a mix must be converted with the same model, hold the model's
resolution and the text column the run reads (:func:`text_column`), and agree on the empty caption.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import types
import urllib.parse
from typing import Any

import numpy as np
from streaming.base.storage import CloudDownloader

from diffusion import schema
from diffusion.errors import ConfigError, DataIntegrityError, DatasetMismatchError, UserError
from diffusion.storage import share_endpoint_with_streaming


def is_remote(path: str) -> bool:
    return urllib.parse.urlparse(path).scheme not in ("", "file")


def side_file_location(path: str, name: str) -> str:
    """Where ``name`` beside the shards' ``index.json`` is: a local path, or the remote URI (for messages)."""
    return path.rstrip("/") + "/" + name if is_remote(path) else os.path.join(path, name)


@contextlib.contextmanager
def side_file(path: str, name: str, timeout: float = 120.0):
    """For the block, a local path to ``name`` beside the shards' ``index.json``: the file itself, or of a
    remote dataset a download into a temporary folder of this process, removed after the block (a run reads
    these at every start: each left a folder in the temporary directory)."""
    if not is_remote(path):
        yield os.path.join(path, name)
        return
    share_endpoint_with_streaming()
    folder = tempfile.mkdtemp(prefix="mds-meta-")  # per process: no download races
    try:
        local, remote = os.path.join(folder, name), side_file_location(path, name)
        try:
            CloudDownloader.direct_download(remote, local, timeout=timeout)
        except Exception as e:
            raise FileNotFoundError(f"could not download {remote} ({type(e).__name__}: {e}): "
                                    f"is {path!r} a dataset written by convert/laion_to_mds.py?") from e
        yield local
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_dataset_info(path: str, timeout: float = 120.0) -> schema.DatasetInfo:
    """``dataset.json`` of a local directory or a remote URI."""
    with side_file(path, schema.DATASET_JSON, timeout) as local:
        try:
            return schema.DatasetInfo.load(os.path.dirname(local))
        except (FileNotFoundError, UserError):
            raise
        except (ValueError, TypeError, AttributeError, OSError) as e:  # JSONDecodeError is a ValueError
            where = side_file_location(path, schema.DATASET_JSON)
            raise DataIntegrityError(f"{where} is not a dataset.json written by convert/laion_to_mds.py "
                                     f"({type(e).__name__}: {one_line(e)}): restore it from a copy or re-convert "
                                     f"the dataset") from e


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def check_compatible(info: schema.DatasetInfo, path: str, resolution: int, text_dim: int) -> None:
    if resolution not in info.resolutions:
        raise DatasetMismatchError(
            f"{path}: the shards hold resolutions {info.resolutions} but the model trains at {resolution} "
            f"(set model.resolution to one of them, or convert with --resolutions {resolution})")
    if info.text_dim != text_dim:
        raise DatasetMismatchError(
            f"{path}: text embeddings have dimension {info.text_dim} (from {info.model}) but the UNet's "
            f"cross_attention_dim is {text_dim}: convert with the model's own text encoder")


def section_name(loader_cfg) -> str:
    return "data.eval" if type(loader_cfg).__name__ == "EvalLoaderConfig" else "data.train"


def loader_streams(loader_cfg) -> list[tuple[str, Any]]:
    """The datasets a loader section reads, each as (its name in errors, its entry): ``data.train.streams``
    (entries with path, local, proportion, repeat, choose), or the section's one ``path``; a bucketed
    ``path`` (converted with ``--buckets``) is one stream per bucket that can fill a global batch
    (:func:`bucket_streams`)."""
    streams = getattr(loader_cfg, "streams", None)
    if not streams:
        buckets = bucket_streams(loader_cfg)
        if buckets:
            return buckets
        one = types.SimpleNamespace(path=loader_cfg.path, local=loader_cfg.local, proportion=None, repeat=None,
                                    choose=None)
        return [(loader_cfg.path, one)]
    for i, s in enumerate(streams):
        if read_dataset_info(s.path, loader_cfg.download_timeout).buckets:
            raise DatasetMismatchError(
                f"{section_name(loader_cfg)}.streams[{i}] ({s.path}) is a bucketed dataset (converted with --buckets): "
                f"give it as {section_name(loader_cfg)}.path, whose batches each come from one bucket")
    return [(f"{section_name(loader_cfg)}.streams[{i}] ({s.path})", s) for i, s in enumerate(streams)]


def is_bucketed(loader_cfg) -> bool:
    """Whether the section reads a bucketed dataset (every global batch then comes from one bucket)."""
    return not getattr(loader_cfg, "streams", None) and bool(bucket_streams(loader_cfg))


def bucket_streams(loader_cfg) -> list[tuple[str, Any]]:
    """The buckets of a bucketed ``path`` as streams. Training: each draws the most whole global batches it
    holds per epoch (streaming's ``choose``: a different subset of a bucket's remainder left out each epoch),
    so each bucket's share of the batches is its share of the samples and no bucket is padded with repeated
    samples, which would depend on the rank count (the unit is the least common multiple of the global
    batch and ``num_canonical_nodes``); a bucket smaller than one unit is left out, and a dataset none of
    whose buckets fills one is refused. ``data.eval``: every bucket whole (the eval loader reads each bucket
    on its own, keeping its last incomplete batch: :func:`~diffusion.loader.mds_source.build_dataloader`).
    [] for a square dataset."""
    try:
        info = read_dataset_info(loader_cfg.path, loader_cfg.download_timeout) if loader_cfg.path else None
    except (FileNotFoundError, DataIntegrityError):
        return []  # reading the section's dataset.json again names the problem
    if info is None or not info.buckets:
        return []
    section = section_name(loader_cfg)
    if loader_cfg.num_samples is not None:  # streaming takes no epoch size beside the buckets' choose
        raise ConfigError(f"{section}.num_samples={loader_cfg.num_samples}: {loader_cfg.path} is a bucketed dataset "
                          f"(converted with --buckets), whose epoch is each bucket's whole batches; set "
                          f"{section}.num_samples=null")
    join = (lambda b: loader_cfg.path.rstrip("/") + "/" + b) if is_remote(loader_cfg.path) else (
        lambda b: os.path.join(loader_cfg.path, b))
    whole = section == "data.eval"
    unit = math.lcm(loader_cfg.batch_size, loader_cfg.num_canonical_nodes or 1)
    kept = [b for b in info.buckets if b["count"] >= (1 if whole else unit)]
    if not kept:
        sizes = ", ".join(f"{b['name']}: {b['count']}" for b in info.buckets)
        raise DatasetMismatchError(
            f"{section}.path {loader_cfg.path}: no bucket holds a global batch of "
            f"{unit} samples ({sizes}): lower {section}.batch_size")
    local = loader_cfg.local
    return [(f"{loader_cfg.path} ({b['name']})",
             types.SimpleNamespace(path=join(b["name"]), local=os.path.join(local, b["name"]) if local else None,
                                   proportion=None, repeat=None,
                                   choose=None if whole else b["count"] // unit * unit)) for b in kept]


# What training depends on in dataset.json: every stream of a mix must record the same.
AGREED_FIELDS = ("model", "scaling_factor", "downsample", "text_dim", "text_length", "pooled_text_dim")
LATENT_FIELDS = ("autoencoder", "latent_channels", "downsample", "scaling_factor", "shift_factor", "latents")


def read_loader_info(loader_cfg, resolution: int | None = None, text_dim: int | None = None) -> schema.DatasetInfo:
    """``dataset.json`` of the section's dataset (of a mix: its first stream's, once every stream's agrees
    with it on :data:`AGREED_FIELDS` and on holding the ``resolution`` column), checked against the
    model's ``resolution`` and ``text_dim`` where given."""
    streams = loader_streams(loader_cfg)
    infos = [read_dataset_info(entry.path, loader_cfg.download_timeout) for _, entry in streams]
    (first_name, _), first = streams[0], infos[0]
    for (name, _), info in zip(streams[1:], infos[1:]):
        differ = [f for f in LATENT_FIELDS if getattr(info, f) != getattr(first, f)]
        if differ:  # a mix of two latent spaces
            raise DatasetMismatchError(
                f"{name}: its latents are {info.latent_space.describe()} where {first_name}'s are "
                f"{first.latent_space.describe()} (dataset.json's {', '.join(differ)}): every stream of a mix "
                f"must be encoded by the same autoencoder, with the same scaling")
        for field in AGREED_FIELDS:
            if getattr(info, field) != getattr(first, field):
                raise DatasetMismatchError(
                    f"{name}: dataset.json records {field}={getattr(info, field)!r} where {first_name} records "
                    f"{field}={getattr(first, field)!r}: every stream of a mix must be converted with the same "
                    f"model (VAE scaling factor, text encoder)")
        if resolution is not None and (resolution in info.resolutions) != (resolution in first.resolutions):
            has, lacks = (first_name, name) if resolution in first.resolutions else (name, first_name)
            raise DatasetMismatchError(
                f"{lacks} has no {first.latent_space.column(resolution)} column where {has} has (the model "
                f"trains at {resolution}): convert it with --resolutions {resolution}, or leave it out of the mix")
    if resolution is not None and text_dim is not None:
        for (name, _), info in zip(streams, infos):
            check_compatible(info, name, resolution, text_dim)
    return first


def text_column(model_text: str, sections) -> str:
    """The text column training reads from the datasets of ``sections`` (``data.train``, ``data.eval``):
    ``text_embeds`` or ``input_ids`` (which the model's text encoder encodes), for ``model.text``
    (``embeds``, ``ids`` or ``auto``: embeddings where every dataset holds them, else ids). A dataset
    that lacks the column, or a mix of datasets of embeddings only and of ids only, is refused."""
    holds = []  # (name, its text storage)
    for section in sections:
        for name, entry in loader_streams(section):
            holds.append((name, read_dataset_info(entry.path, section.download_timeout).text))
    wanted = model_text
    if wanted == "auto":
        wanted = "embeds" if all(t != schema.TEXT_IDS_ONLY for _, t in holds) else "ids"
    column = schema.TEXT_EMBEDS if wanted == "embeds" else schema.INPUT_IDS
    lacking = [(name, text) for name, text in holds if column not in schema.text_columns(text)]
    if lacking:
        name, text = lacking[0]
        if model_text == "auto":  # ids chosen because some dataset holds only ids: this one holds only embeds
            ids_only = next(n for n, t in holds if t == schema.TEXT_IDS_ONLY)
            raise DatasetMismatchError(
                f"{name} holds text embeddings only where {ids_only} holds token ids only (converted with --text "
                f"embeds and --text ids): a run conditions every sample one way; convert one of them again with "
                f"--text both, or with the other's --text")
        if column == schema.INPUT_IDS:
            raise DatasetMismatchError(
                f"{name} holds no token ids (converted with --text embeds) but model.text=ids: set model.text to "
                f"embeds or auto, or convert with --text ids or both")
        raise DatasetMismatchError(
            f"{name} holds token ids but no text embeddings (converted with --text ids) and model.text=embeds: "
            f"set model.text to ids or auto (the text encoder then runs on the training device), or convert with "
            f"--text embeds or both")
    return column


def load_empty_input_ids(loader_cfg) -> np.ndarray:
    """The token ids of "" that caption dropout substitutes in a batch of ids: ``dataset.json``'s
    ``empty_input_ids`` (a dataset written before it was recorded: its tokenizer's), equal for every
    stream of a mix."""
    loaded = []
    for name, entry in loader_streams(loader_cfg):
        info = read_dataset_info(entry.path, loader_cfg.download_timeout)
        if info.empty_input_ids is not None:
            ids = np.asarray(info.empty_input_ids, dtype=np.int64)
        else:
            from diffusion.models.loading import load_tokenizer
            from diffusion.models.text_encoder import empty_caption_ids
            ids = empty_caption_ids(load_tokenizer(info.text_encoder_ref)).astype(np.int64)
        if loaded and not np.array_equal(loaded[0][1], ids):
            raise DatasetMismatchError(f"{name}: the token ids of the empty caption differ from those of "
                                       f"{loaded[0][0]}: every stream of a mix must be tokenized by the same tokenizer")
        loaded.append((name, ids))
    return loaded[0][1]


def load_empty_tokens(loader_cfg) -> int:
    """The token count of "" (``dataset.json``'s ``empty_text_tokens``): what caption dropout substitutes
    for a dropped caption's attention mask; every dataset must store token counts."""
    counts = set()
    for name, entry in loader_streams(loader_cfg):
        info = read_dataset_info(entry.path, loader_cfg.download_timeout)
        if not info.has_tokens:
            raise DatasetMismatchError(
                f"{name} stores no token counts (text_tokens; converted before they were stored), which "
                f"model.text_mask needs for the attention masks: convert it again, or set model.text_mask=false")
        counts.add(int(info.empty_text_tokens))
    if len(counts) > 1:
        raise DatasetMismatchError(f"{section_name(loader_cfg)}: the datasets' empty captions have different token "
                                   f"counts ({sorted(counts)}): every stream of a mix must use the same tokenizer")
    return counts.pop()


def load_empty_embedding(loader_cfg) -> np.ndarray:
    """``empty_text_embeds.npy`` of the section's dataset; of a mix, the first stream's, checked equal in
    every other stream (caption dropout substitutes one embedding whatever stream a sample is from)."""
    loaded = []
    for name, entry in loader_streams(loader_cfg):
        with side_file(entry.path, schema.EMPTY_TEXT_EMBEDS, loader_cfg.download_timeout) as path:
            try:
                empty = np.load(path)
            except FileNotFoundError:
                raise
            except (ValueError, OSError, EOFError) as e:
                where = side_file_location(entry.path, schema.EMPTY_TEXT_EMBEDS)  # not the download's copy
                raise DataIntegrityError(f"{where} is not an array written by convert/laion_to_mds.py "
                                         f"({type(e).__name__}: {one_line(e)}): restore it from a copy, or "
                                         f"re-convert the dataset") from e
        if loaded:
            first_name, first = loaded[0]
            if first.shape != empty.shape or not np.array_equal(first, empty):
                how = (f"shape {empty.shape} vs {first.shape}" if first.shape != empty.shape
                       else "other values")
                raise DatasetMismatchError(
                    f"{name}: its {schema.EMPTY_TEXT_EMBEDS} differs from that of {first_name} ({how}): every "
                    f"stream of a mix must be converted with the same text encoder")
        loaded.append((name, empty))
    return loaded[0][1]
