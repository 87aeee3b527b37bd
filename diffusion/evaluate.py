"""``python -m diffusion.evaluate``: the command as the README has always written it; the code is
:mod:`diffusion.sample.evaluate`."""

from diffusion.sample.evaluate import main

if __name__ == "__main__":
    from diffusion import cli
    cli.run(main, "evaluate")
