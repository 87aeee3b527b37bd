"""Run as a process (one rank of a world from RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE): the training
loader over a bucketed dataset, drawing one of two captions per sample (``CAPTIONS``); writes each
batch's sample indices, moments shape and each sample's text embedding sum (which caption it drew) as JSON.

    python bucket_batches.py DATASET TEXT_DIM GLOBAL_BATCH OUT.json [SKIP_BATCHES]

With SKIP_BATCHES, the loader's state after that many batches is saved and a new loader resumes from it
(what Composer does after a restart): the batches written are the resumed loader's. Without it, the eval
loader's batches (``drop_last=False``, a global batch of :func:`eval_batch_size`) go to OUT.json.eval too.
"""

import json
import os
import sys

from diffusion import schema
from diffusion.train.config import EvalLoaderConfig, TrainLoaderConfig
from diffusion.loader import mds_source

CAPTIONS = {"caption": 0.5, "recap": 0.5}


def batches(loader, limit=None):
    out = []
    for batch in loader:
        out.append({"keys": batch[schema.KEY] if schema.KEY in batch else None,
                    "index": batch[schema.BATCH_SAMPLE_INDEX].tolist(),
                    "shape": list(batch[schema.BATCH_MOMENTS].shape[1:]),
                    "text": [round(float(t.float().sum()), 2) for t in batch[schema.BATCH_TEXT_EMBEDS]]})
        if limit is not None and len(out) == limit:
            break
    return out


def eval_batch_size(path):
    """Even (two ranks split it) and larger than the smallest bucket, which is then one incomplete batch."""
    return (min(b["count"] for b in schema.DatasetInfo.load(path).buckets) // 2 + 1) * 2


def main(path, text_dim, global_batch, out, skip=None):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = TrainLoaderConfig(path=path, batch_size=int(global_batch), num_workers=0, persistent_workers=False,
                            num_canonical_nodes=1, caption_dropout=0.0, captions=CAPTIONS)
    loader = mds_source.build_dataloader(cfg, resolution=64, text_dim=int(text_dim), world_size=world, seed=5)
    if skip is not None:
        batches(loader, int(skip))
        state = loader.state_dict()
        del loader
        loader = mds_source.build_dataloader(cfg, resolution=64, text_dim=int(text_dim), world_size=world, seed=5)
        loader.load_state_dict(state)
    with open(out, "w") as f:
        json.dump(batches(loader), f)
    if skip is None:
        held_out = EvalLoaderConfig(path=path, batch_size=eval_batch_size(path), num_workers=0)
        loader = mds_source.build_dataloader(held_out, resolution=64, text_dim=int(text_dim), world_size=world,
                                             drop_last=False)
        with open(out + ".eval", "w") as f:
            json.dump(batches(loader), f)


if __name__ == "__main__":
    main(*sys.argv[1:])
