"""``python -m diffusion.kit --preset {tiny,sd2-base,tiny-clip} --out DIR``: see diffusion.kit.build."""

from diffusion import cli
from diffusion.kit.build import main

cli.run(main, "kit")
