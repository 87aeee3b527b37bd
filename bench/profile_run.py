"""run.py with torch's profiler over a few steady batches: where a training batch's host and device time go.

    composer -n 1 bench/profile_run.py OUT_DIR yamls/sd2-base-256.yaml key=value ...   # what run.py takes
    PROFILE_BATCHES=12:3 ...  # profile batches 12, 13, 14 (default 15:3)

Writes ``OUT_DIR/profile.txt`` (each profiled batch's wall time from the previous batch's end, its data fetch
included; the wall time between Composer's events; the ops by host time and by device time) and
``OUT_DIR/trace.json`` (chrome://tracing, Perfetto). Keep the window between evals (the file says when an eval
ran inside it). Everything else is run.py as is. ``bench_product.py --profile`` runs it as one of its variants
and places the window past its first eval.
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
        """Profiles batches first .. first+count-1 (Composer's numbers, from 1), each from the previous batch's end,
        so its data fetch counts; times every Composer event in the window; then writes the tables."""

        def __init__(self):
            self.profiler, self.last, self.walls, self.events, self.evals = None, None, [], {}, 0

        def run_event(self, event, state, logger):
            now = time.perf_counter()
            if self.profiler is not None and self.last is not None:  # time since the previous event, by event
                name = f"{self.last[0]} -> {event.value}"
                self.events[name] = self.events.get(name, 0.0) + now - self.last[1]
            if self.profiler is not None:
                self.last = (event.value, now)
                if event.value == "eval_start":
                    self.evals += 1
            super().run_event(event, state, logger)

        def batch_end(self, state, logger):
            batch = int(state.timestamp.batch)  # this batch's number (Composer counts it before BATCH_END)
            if self.profiler is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                now = time.perf_counter()
                self.walls.append(now - self.started)
                self.started = now
                if batch == first + count - 1:
                    self.profiler.__exit__(None, None, None)
                    self.write(self.profiler)
                    self.profiler = None
            elif batch == first - 1:  # the window opens here: the next batch's fetch is inside it
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.profiler = torch.profiler.profile(activities=activities, record_shapes=False)
                self.profiler.__enter__()
                self.started, self.last = time.perf_counter(), ("batch_end", time.perf_counter())

        def write(self, profiler):
            os.makedirs(out, exist_ok=True)
            table = profiler.key_averages()
            device = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            with open(os.path.join(out, "profile.txt"), "w") as f:
                f.write(f"batches {first}..{first + count - 1}, each from the previous batch's end (its fetch "
                        f"included), synchronized: {', '.join(f'{w * 1e3:.1f} ms' for w in self.walls)}\n")
                if self.evals:
                    f.write(f"NOTE: {self.evals} eval(s) ran inside the window: move PROFILE_BATCHES\n")
                f.write("\n== wall time between Composer's events, summed over the window (ms)\n")
                for name, seconds in sorted(self.events.items(), key=lambda kv: -kv[1]):
                    f.write(f"{seconds * 1e3:10.1f}  {name}\n")
                f.write("\n== by host time (self)\n" + table.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
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
