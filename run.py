"""Train Stable Diffusion: ``composer run.py yamls/sd2-base-256.yaml [section.key=value ...]``.

Also ``python run.py ...`` for one process; with no YAML, the embedded CPU default yamls/tiny-cpu.yaml.
"""

from diffusion import cli
from diffusion.launch import main

if __name__ == "__main__":
    cli.run(main, "run.py")
