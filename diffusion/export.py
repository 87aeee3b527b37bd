"""``python -m diffusion.export``: the command as the README has always written it; the code is
:mod:`diffusion.sample.export`."""

from diffusion.sample.export import main

if __name__ == "__main__":
    from diffusion import cli
    cli.run(main, "export")
