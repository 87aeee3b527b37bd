"""Ray Data side of online mode: the converter's read → transform → encode pipeline as a training stream.

Nothing here re-implements an operator: the pipeline is :func:`diffusion.data.convert.build_pipeline`
(the same reader, :class:`~diffusion.data.transforms.ImageCaptionTransform` and
:class:`~diffusion.data.encoders.LatentTextEncoder` that write MDS offline), its pools are sized by the
converter's :func:`~diffusion.data.convert.plan_pools` from what the training workers leave free, and
rejected rows are recorded and counted the converter's way (reject files, counted once per key).
Where the MDS sink would be, the columns training needs go to the Ray Train workers instead.
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from diffusion.config import Config
from diffusion.data import contract, encoders
from diffusion.data.convert import ConvertConfig, PoolPlan, build_pipeline, plan_pools
from diffusion.data.convert_summary import done_keys
from diffusion.models import loading


def online_resolution(cfg: Config) -> int:
    return int(cfg.data.online.resolution or cfg.model.resolution)


def convert_config(cfg: Config, work_dir: str) -> ConvertConfig:
    """The converter's view of ``data.online``: same knobs, and ``work_dir`` where the MDS output would be."""
    o = cfg.data.online
    return ConvertConfig(
        input=o.input, output=work_dir, model=cfg.model.ref, resolutions=(online_resolution(cfg),),
        batch_size=o.encoder_batch_size, transform_batch_size=o.transform_batch_size,
        num_transformers=o.num_transformers, cpus_per_transformer=o.cpus_per_transformer,
        num_encoders=o.num_encoders, encoder_gpus=o.encoder_gpus, accelerator_type=o.encoder_accelerator_type,
        progress=False)


def data_resources(cluster: dict, cfg: Config) -> dict:
    """What the cluster has left for the data pipeline once the training workers hold their share."""
    o = cfg.data.online
    return {"CPU": float(cluster.get("CPU", 0)) - o.num_train_workers * o.train_cpus,
            "GPU": float(cluster.get("GPU", 0)) - o.num_train_workers * o.train_gpus}


def plan_online_pools(cluster: dict, cfg: Config) -> PoolPlan:
    """Transform and encoder pools sized by the converter's planner, from the non-training resources."""
    left = data_resources(cluster, cfg)
    if left["CPU"] <= 0:
        raise ValueError(
            f"the training workers ({cfg.data.online.num_train_workers} x {cfg.data.online.train_cpus} CPU) hold "
            f"all {cluster.get('CPU', 0)} CPUs of the cluster: nothing is left to read and transform the data "
            f"(lower data.online.train_cpus or num_train_workers)")
    return plan_pools(left, convert_config(cfg, ""))


def build_stream(cfg: Config, plan: PoolPlan, work_dir: str):
    """The Ray Dataset of encoded rows for training (lazy: Ray Train executes it, once per pass).

    Its rows also carry keys, captions, sizes and the per-row stage timings (``_*_seconds``, which the
    workers sum to show where the time goes); :class:`ToTrainingBatch` keeps what the model needs.
    """
    return build_pipeline(convert_config(cfg, work_dir), work_dir, frozenset(), plan)


def count_rejects(work_dir: str) -> dict[str, int]:
    """Rejected rows by reason, each key counted once however many passes or restarts met it."""
    _, rejected = done_keys(work_dir)
    return dict(collections.Counter(rejected.values()))


def stream_info(cfg: Config) -> tuple[contract.DatasetInfo, np.ndarray]:
    """What ``dataset.json`` and ``empty_text_embeds.npy`` tell offline training, for the stream.

    The empty-caption embedding comes from the same text encoder the encoder actors run.
    """
    vae_config = loading.load_vae_config(cfg.model.ref)
    text = encoders.TextEncoder(cfg.model.ref, device="cpu")
    empty = text.encode_captions([""])[0]
    info = contract.DatasetInfo(
        model=cfg.model.ref, scaling_factor=float(vae_config.get("scaling_factor", 0.18215)),
        resolutions=[online_resolution(cfg)], text_dim=text.dim, downsample=loading.vae_downsample(vae_config))
    return info, empty


class ToTrainingBatch:
    """Stream columns → the batch the model consumes (the MDS loader's keys), with caption dropout.

    Dropout happens here, at load time, and substitutes the empty-caption embedding, as offline; the
    stream has no stable sample index, so the draw comes from a per-rank generator.
    """

    def __init__(self, resolution: int, empty_text_embeds: np.ndarray, caption_dropout: float = 0.0, seed: int = 0):
        self.moments_column = contract.vae_moments_column(resolution)
        self.empty_text_embeds = torch.as_tensor(np.asarray(empty_text_embeds, dtype=np.float16))
        self.caption_dropout, self.seed = float(caption_dropout), int(seed)
        self._generator = None  # made in the worker, where the rank is known

    def _drop_mask(self, n: int) -> torch.Tensor:
        if self._generator is None:
            from composer.utils import dist
            self._generator = torch.Generator().manual_seed(self.seed * 1_000_003 + dist.get_global_rank())
        return torch.rand(n, generator=self._generator) < self.caption_dropout

    def __call__(self, columns: dict) -> dict:
        text = torch.from_numpy(np.ascontiguousarray(columns[contract.TEXT_EMBEDS]))
        if self.caption_dropout > 0:
            drop = self._drop_mask(len(text))
            text = torch.where(drop[:, None, None], self.empty_text_embeds.to(text.dtype), text)
        return {contract.BATCH_MOMENTS: torch.from_numpy(np.ascontiguousarray(columns[self.moments_column])),
                contract.BATCH_TEXT_EMBEDS: text,
                contract.BATCH_INPUT_IDS: torch.from_numpy(np.asarray(columns[contract.INPUT_IDS], dtype=np.int64))}
