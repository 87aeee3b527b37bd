"""Ray Data side of online mode: the converter's read → transform → encode pipeline as a training stream.

Nothing here re-implements an operator: the pipeline is :func:`diffusion.convert.pipeline.build_pipeline`
(the same reader, :class:`~diffusion.convert.transforms.ImageCaptionTransform` and
:class:`~diffusion.convert.encoders.LatentTextEncoder` that write MDS offline), its pools are sized by the
converter's :func:`~diffusion.convert.pipeline.plan_pools` from what the training workers leave free, and
rejected rows are recorded and counted the converter's way (reject files, counted once per key).
Where the MDS sink would be, the columns training needs go to the Ray Train workers instead.
"""

from __future__ import annotations

import collections

import numpy as np

from diffusion.train.config import Config
from diffusion import schema
from diffusion.convert import encoders
from diffusion.convert.pipeline import ConvertConfig, PoolPlan, build_pipeline, plan_pools
from diffusion.convert.summary import done_keys
from diffusion.errors import ConfigError


def stream_text(cfg: Config) -> str:
    """The stream's text storage: token ids when ``model.text=ids`` (the Ray pipeline runs no text encoder;
    the training workers encode the ids), else text embeddings (the encoder actors run it, as offline)."""
    return schema.TEXT_IDS_ONLY if cfg.model.text == "ids" else schema.TEXT_EMBEDS_ONLY


def convert_config(cfg: Config, work_dir: str) -> ConvertConfig:
    """The converter's view of ``data.online`` (the same pipeline settings), ``work_dir`` where the MDS
    output would be."""
    o = cfg.data.online
    return ConvertConfig(input=o.input, output=work_dir, model=cfg.model.ref, resolutions=(cfg.model.resolution,),
                         progress=False, text=stream_text(cfg), **o.pipeline_settings())


def data_resources(cluster: dict, cfg: Config) -> dict:
    """What the cluster has left for the data pipeline once the training workers hold their share."""
    o = cfg.data.online
    return {"CPU": float(cluster.get("CPU", 0)) - o.num_train_workers * o.train_cpus,
            "GPU": float(cluster.get("GPU", 0)) - o.num_train_workers * o.train_gpus}


def plan_online_pools(cluster: dict, cfg: Config, nodes: int = 1) -> PoolPlan:
    """Transform and encoder pools sized by the converter's planner, from the non-training resources of
    the ``cluster`` (over ``nodes`` nodes)."""
    left = data_resources(cluster, cfg)
    if left["CPU"] <= 0:
        raise ConfigError(
            f"the training workers ({cfg.data.online.num_train_workers} x {cfg.data.online.train_cpus} CPU) hold "
            f"all {cluster.get('CPU', 0)} CPUs of the cluster: nothing is left to read and transform the data "
            f"(lower data.online.train_cpus or num_train_workers)")
    return plan_pools(left, convert_config(cfg, ""), nodes)


def build_stream(cfg: Config, plan: PoolPlan, work_dir: str):
    """The Ray Dataset of encoded rows for training (lazy: Ray Train executes it, once per pass).

    Its rows also carry keys, captions, sizes and the per-row stage timings (``_*_seconds``, which the
    workers sum to show where the time goes); :class:`~diffusion.loader.batches.ToModelBatch` keeps what
    the model needs.
    """
    return build_pipeline(convert_config(cfg, work_dir), work_dir, frozenset(), plan)


def count_rejects(work_dir: str) -> dict[str, int]:
    """Rejected rows by reason, each key counted once however many passes or restarts met it."""
    _, rejected = done_keys(work_dir)
    return dict(collections.Counter(rejected.values()))


def stream_info(cfg: Config) -> tuple[schema.DatasetInfo, np.ndarray]:
    """What ``dataset.json`` and ``empty_text_embeds.npy`` tell offline training, for the stream. Its rows
    carry each caption's token count (``text_tokens``), as converted shards do: the attention mask of a T5
    text encoder and of ``model.text_mask``."""
    return encoders.describe_dataset(cfg.model.ref, [cfg.model.resolution], stream_text(cfg),
                                     cfg.data.online.text_length)
