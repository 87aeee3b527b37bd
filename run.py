"""Train Stable Diffusion: ``composer run.py yamls/sd2-base-256.yaml [section.key=value ...]``.

Also ``python run.py ...`` for one process; with no YAML, the embedded CPU default yamls/tiny-cpu.yaml.
"""

import sys

from diffusion.config import ConfigError
from diffusion.train import main

if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
