"""Export a trained model as a diffusers pipeline directory.

    python -m diffusion.export --checkpoint CKPT --out DIR

``DIR`` gets the diffusers layout (``unet/ vae/ text_encoder/ tokenizer/ scheduler/ model_index.json``)
that ``diffusers.StableDiffusionPipeline.from_pretrained(DIR)`` loads: the UNet from the checkpoint (EMA
weights unless ``--no-ema``), the VAE, text encoder, tokenizer and scheduler of the training run's model
reference, with the VAE scaling factor and prediction type training used written into their configs.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from diffusion.models import loading, sampling

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def export_pipeline(checkpoint: str, out: str, *, model_ref: str | None = None, ema: bool = True,
                    scheduler: str | None = None, dtype: str = "float32") -> str:
    """Write ``checkpoint`` as a diffusers pipeline to ``out`` and return ``out``.

    ``scheduler`` (ddim, euler, dpm++) swaps the model reference's scheduler class for a sampler of the
    same noise schedule; by default the reference's own scheduler config is kept.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    trained = sampling.load_trained(checkpoint, model_ref=model_ref, ema=ema)
    if os.path.abspath(out) in (os.path.abspath(trained.model_ref), os.path.abspath(checkpoint)):
        raise ValueError(f"--out {out!r} is where the model comes from; export to a new directory")
    sampler = sampling.Sampler(trained.model_ref, scheduler=scheduler or "ddim",
                               scaling_factor=trained.scaling_factor, prediction_type=trained.prediction_type)
    if scheduler is None:
        sampler.scheduler = _reference_scheduler(trained.model_ref, trained.prediction_type)
    pipe = sampler.pipeline(trained.unet)
    pipe.to(dtype=DTYPES[dtype])
    os.makedirs(out, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def _reference_scheduler(model_ref: str, prediction_type: str | None):
    """The model reference's scheduler, as its config names it, predicting what training predicted."""
    import diffusers
    path = os.path.join(loading.resolve_model(model_ref, components=("scheduler",)), "scheduler")
    with open(os.path.join(path, "scheduler_config.json")) as f:
        config = json.load(f)
    cls = getattr(diffusers, config["_class_name"])
    overrides = {"prediction_type": prediction_type} if prediction_type else {}
    return cls.from_config(config, **overrides)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="Composer checkpoint file or diffusers directory")
    parser.add_argument("--out", required=True, help="output directory (diffusers layout)")
    parser.add_argument("--model", default=None,
                        help="model reference for VAE/text encoder/tokenizer/scheduler (default: the checkpoint's)")
    parser.add_argument("--no-ema", dest="ema", action="store_false", help="export the raw, not the EMA, weights")
    parser.add_argument("--scheduler", choices=sampling.SCHEDULERS, default=None,
                        help="save this sampler instead of the model reference's scheduler class")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    args = parser.parse_args(argv)
    out = export_pipeline(args.checkpoint, args.out, model_ref=args.model, ema=args.ema,
                          scheduler=args.scheduler, dtype=args.dtype)
    print(f"wrote {os.path.abspath(out)}: load with diffusers.StableDiffusionPipeline.from_pretrained({out!r})")


if __name__ == "__main__":
    from diffusion import cli
    cli.run(main, "export")
