"""``python -m diffusion.generate``: the command as the README has always written it; the code is
:mod:`diffusion.sample.generate`."""

from diffusion.sample.generate import main

if __name__ == "__main__":
    from diffusion import cli
    cli.run(main, "generate")
