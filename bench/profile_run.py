"""run.py with torch's profiler over a few steady batches: where a training batch's host and device time go.

    composer -n 1 bench/profile_run.py OUT_DIR yamls/sd2-base-256.yaml key=value ...   # what run.py takes
    PROFILE_BATCHES=12:3 ...  # profile batches 12, 13, 14 (default 15:3: past compilation and the first eval)

Writes ``OUT_DIR/profile.txt`` (the ops by host time and by device time, and the step's wall time split into
Composer's events) and ``OUT_DIR/trace.json`` (chrome://tracing, Perfetto). Everything else is run.py as is.
``bench_product.py --profile`` runs it as one of its variants.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def profiling_callback(out: str, first: int, count: int):
    import torch
    from composer.core import Callback

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    class Profile(Callback):
        """Profiles batches first .. first+count-1 (Composer's batch numbers, from 1), then writes the tables."""

        def __init__(self):
            self.profiler, self.started, self.walls = None, None, []

        def batch_start(self, state, logger):
            batch = int(state.timestamp.batch) + 1
            if batch == first:
                self.profiler = torch.profiler.profile(activities=activities, record_shapes=False)
                self.profiler.__enter__()
            if self.profiler is not None:
                self.started = time.perf_counter()

        def batch_end(self, state, logger):
            if self.profiler is None:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.walls.append(time.perf_counter() - self.started)
            if int(state.timestamp.batch) == first + count - 1:
                self.profiler.__exit__(None, None, None)
                self.write(self.profiler)
                self.profiler = None

        def write(self, profiler):
            os.makedirs(out, exist_ok=True)
            table = profiler.key_averages()
            device = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            with open(os.path.join(out, "profile.txt"), "w") as f:
                f.write(f"batches {first}..{first + count - 1}: wall per batch (synchronized at batch end) "
                        f"{', '.join(f'{w * 1e3:.1f} ms' for w in self.walls)}\n\n")
                f.write("== by host time (self)\n" + table.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
                f.write("== by host time (with children)\n" + table.table(sort_by="cpu_time_total", row_limit=40) + "\n")
                f.write(f"== by {device}\n" + table.table(sort_by=device, row_limit=40) + "\n")
            profiler.export_chrome_trace(os.path.join(out, "trace.json"))
            print(f"profile: {out}/profile.txt, {out}/trace.json", flush=True)

    return Profile()


def main() -> None:
    out, sys.argv = sys.argv[1], ["run.py", *sys.argv[2:]]
    first, count = (int(x) for x in os.environ.get("PROFILE_BATCHES", "15:3").split(":"))
    from diffusion import cli
    from diffusion.launch import main as run_main
    from diffusion.train import trainer as trainer_module
    build = trainer_module.build_trainer

    def build_with_profile(cfg, *args, **kwargs):
        trainer = build(cfg, *args, **kwargs)
        trainer.state.callbacks.append(profiling_callback(out, first, count))
        return trainer

    trainer_module.build_trainer = build_with_profile
    cli.run(run_main, "run.py")


if __name__ == "__main__":
    main()
