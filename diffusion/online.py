"""Online mode: raw images and captions stream through transform and encode straight into training.

    python -m diffusion.online yamls/tiny-online-cpu.yaml [section.key=value ...]

The same as ``python run.py`` with ``data.train.source: stream`` (set here whatever the YAML says): one
Ray job where the converter's pipeline (read tasks → transform actors on CPUs → encoder actors on their
own GPUs, or CPUs) feeds Ray Train workers, each running the Composer trainer that ``run.py`` builds, on
batches of the same data contract. No MDS is written. A worker that dies takes the group down; Ray Train
restarts it (``data.online.max_failures``) and Composer's ``autoresume`` resumes from the last
checkpoint in ``trainer.save_folder``, which ``run.py`` can also load for further offline training.
See :mod:`diffusion.stream.ray_workers`.
"""

from __future__ import annotations

import os
import sys

ONLINE_HELP = """Train from raw image-caption data with no MDS step: Ray Data reads, transforms and encodes
rows (the converter's operators) and streams them into Ray Train workers, each running run.py's trainer.

Input: a YAML config like run.py's, plus a data.online section (raw input, work_dir, pools, workers).
Output: checkpoints in trainer.save_folder (loadable by run.py), reject records in data.online.work_dir."""
ONLINE_EXAMPLES = """examples:
  python -m diffusion.kit.sample --out out/demo/raw --n 2048
  python -m diffusion.online yamls/tiny-online-cpu.yaml trainer.max_duration=50ba"""


DEFAULT_YAML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "yamls",
                            "tiny-online-cpu.yaml")


def main(argv: list[str] | None = None):
    from diffusion import launch as command
    path, overrides = command.parse_args(sys.argv[1:] if argv is None else argv, prog="python -m diffusion.online",
                                         description=ONLINE_HELP, examples=ONLINE_EXAMPLES, default_yaml=DEFAULT_YAML)
    return command.main_with(path, [*overrides, "data.train.source=stream"])


if __name__ == "__main__":
    from diffusion import cli
    cli.run(main, "online")
