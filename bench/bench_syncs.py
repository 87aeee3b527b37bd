"""Host syncs per training batch of run.py's trainer, counted on CPU: what a GPU would wait on.

    python bench/bench_syncs.py yamls/sd2-base-256.yaml model.ref=.cache/kit/tiny model.resolution=64 \
        data.train.path=DIR data.train.local=null data.train.batch_size=8 data.eval=null trainer.fsdp=null \
        trainer.precision=fp32 callbacks.image_logger=null callbacks.cost_projection.resolution=64 \
        loggers.wandb=null loggers.progress_bar=null trainer.save_folder=null trainer.max_duration=6ba

On a GPU every read of a device tensor's value on the host (``.item()``, ``float()``, ``bool()``, ``nonzero``,
...) waits for the queued kernels, so the host cannot queue the next batch's kernels while the GPU works. Here a
dispatch mode counts the ops that would read a value back (``aten._local_scalar_dense`` and friends) between
consecutive batch starts, and names the code that asked for each (first frame outside torch). Reads made by
torch's non-fused AdamW of its CPU step counters are left out: on a GPU the YAMLs' AdamW runs fused, with
no read-back. BENCHMARKS.md has the table (session 33).
"""

from __future__ import annotations

import collections
import pathlib
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

READS = {"_local_scalar_dense", "is_nonzero", "equal", "allclose", "nonzero", "masked_select", "unique"}


def _site(stack) -> str | None:
    """The first frame outside torch that led to the read, or None for the optimizer's own CPU step counters."""
    frames = [f for f in stack if "_python_dispatch" not in f.filename and "bench_syncs" not in f.filename]
    if any("/torch/optim/" in f.filename for f in frames[-3:]):
        return None
    for f in reversed(frames):
        if "/torch/" not in f.filename:
            where = f.filename.split("site-packages/")[-1].split(str(ROOT) + "/")[-1]
            return f"{where}:{f.lineno} ({f.line.strip()[:70] if f.line else ''})"
    return "torch"


def main(argv=None) -> int:
    from composer.core import Callback
    from torch.utils._python_dispatch import TorchDispatchMode

    from diffusion.train.config import load_config
    from diffusion.train.trainer import build_trainer

    argv = sys.argv[1:] if argv is None else argv
    reads, sites, counting = [0], collections.Counter(), [False]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "").split(".")[0] in READS:
                site = _site(traceback.extract_stack()[:-1])
                if site is not None:
                    reads[0] += 1
                    if counting[0]:
                        sites[site] += 1
            return func(*args, **(kwargs or {}))

    starts = []

    class Mark(Callback):
        def batch_start(self, state, logger):
            starts.append(reads[0])
            counting[0] = len(starts) >= 3  # sites from the third batch on (past the first batch's set-up)

        def fit_end(self, state, logger):
            starts.append(reads[0])

    trainer = build_trainer(load_config(argv[0], argv[1:]))
    trainer.state.callbacks.append(Mark())
    with Count():
        trainer.fit()
    per_batch = [b - a for a, b in zip(starts, starts[1:])]
    counted = max(1, len(per_batch) - 2)
    print(f"host reads per batch: {per_batch}")
    print("| reads per batch | site |\n|---:|---|")
    for site, n in sites.most_common():
        print(f"| {n / counted:.1f} | `{site}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
