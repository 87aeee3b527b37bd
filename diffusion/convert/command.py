"""The converter's command, ``python convert/laion_to_mds.py``: :func:`main` parses the flags
(:class:`~diffusion.convert.config.ConvertConfig`, one per field), then runs the pipeline.

Light on purpose: ``--help``, a bad flag and every check of :mod:`diffusion.convert.preflight` (inputs,
models, a re-run's settings) answer before Ray, streaming, torch or any model loads;
:mod:`diffusion.convert.pipeline` is imported once they hold.
"""

from __future__ import annotations

import argparse

from diffusion import cli
from diffusion.convert.config import ConvertConfig


CONVERT_EXAMPLES = """examples:
  python convert/laion_to_mds.py --input raw/ --output mds/ --model stabilityai/stable-diffusion-2-base \\
      --resolutions 256 512
  python convert/laion_to_mds.py --input s3://bucket/raw/ --output s3://bucket/mds --model DIR --address auto
  python convert/laion_to_mds.py --input raw/ --output mds/ --model DIR --resolutions 512 --buckets preset
  python convert/laion_to_mds.py --input raw/ --output mds/ --model DIR --dedupe bytes \\
      --where "aesthetic >= 5.0 and punsafe < 0.1 and pwatermark < 0.8"   # LAION metadata filter
  python convert/laion_to_mds.py --input raw/ --output mds/ --model DIR \\
      --recaption Salesforce/blip-image-captioning-large    # a new caption per image, column "recaption"

Re-running the same command after a crash or Ctrl-C resumes: the output ends up with exactly the
samples of a clean run. A re-run with other settings (model, resolutions, columns, image checks,
--where, --dedupe, --recaption) is refused before anything is touched."""


def main(argv=None):
    """``python convert/laion_to_mds.py``: parse the flags (one per :class:`ConvertConfig` field), convert
    (:func:`~diffusion.convert.pipeline.run_conversion`, loaded once the flags hold) and print the summary."""
    parser = argparse.ArgumentParser(
        prog="python convert/laion_to_mds.py", epilog=CONVERT_EXAMPLES,
        description="Convert raw image-caption data into MDS shards of VAE moments and text embeddings "
                    "(plus dataset.json and empty_text_embeds.npy) with a Ray Data pipeline.",
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=32))
    cli.add_flags(parser, ConvertConfig)
    cfg = cli.from_flags(ConvertConfig, parser.parse_args(argv))
    from diffusion.convert.preflight import preflight
    checked = preflight(cfg)  # a wrong input, model or re-run setting: one line, before the heavy imports
    from diffusion.convert.pipeline import run_conversion  # Ray, streaming, torch and the models: after the checks
    summary = run_conversion(cfg, checked)
    print(summary.table())
    return summary
