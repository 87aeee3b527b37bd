"""Export a trained model as a diffusers pipeline directory.

A UNet exports as a ``StableDiffusionPipeline``; an MMDiT (``SD3Transformer2DModel``, trained with flow
matching) as a ``StableDiffusion3Pipeline`` with its flow-matching scheduler, its three text-encoder slots
empty (load it with ``from_pretrained(DIR, text_encoder=None, ...)`` for each, as diffusers' docs do
for SD3 without T5) and our one text encoder and tokenizer in ``text_encoder/`` and ``tokenizer/``
beside them: call it with the prompt embeddings :func:`prompt_inputs` makes from them
(``pipe(**prompt_inputs(pipe, "a prompt"), height=..., width=...)``, as the export prints; a ``SanaPipeline``
likewise, with ``use_resolution_binning=False``), and it draws the images our sampler (``diffusion.generate
--checkpoint DIR``) draws. A Flux transformer trained with a model reference of Flux's two text encoders (the
tiny-flux kit) exports as a ``FluxPipeline`` with both in their own slots (CLIP in ``text_encoder/``, T5 in
``text_encoder_2/``): call it with a prompt string (``negative_prompt=""``, ``true_cfg_scale`` and
``max_sequence_length`` as trained).

    python -m diffusion.export --checkpoint CKPT --out DIR

``DIR`` gets the diffusers layout (``unet/ vae/ text_encoder/ tokenizer/ scheduler/ model_index.json``)
that ``diffusers.StableDiffusionPipeline.from_pretrained(DIR)`` loads: the UNet from the checkpoint (EMA
weights unless ``--no-ema``), the VAE, text encoder, tokenizer and scheduler of the training run's model
reference, with the VAE scaling factor, prediction type and noise schedule training used written into
their configs. A model trained with zero terminal SNR gets ``rescale_betas_zero_snr: true`` and
``timestep_spacing: "trailing"`` in ``scheduler/scheduler_config.json``, so diffusers' own pipeline
samples it as ``diffusion.generate`` does (pass ``guidance_rescale=0.7`` to the pipeline call, as
``diffusion.generate`` does by default for such models: it is a call argument, not a config).
"""

from __future__ import annotations

import argparse
import errno
import inspect
import json
import os

import torch

from diffusion.errors import UserError
from diffusion import cli, schema
from diffusion.models import checkpoint as checkpoints, denoisers, loading, sampling

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def export_pipeline(checkpoint: str, out: str, *, model_ref: str | None = None, ema: bool = True,
                    scheduler: str | None = None, dtype: str = "float32", overwrite: bool = False) -> str:
    """Write ``checkpoint`` as a diffusers pipeline to ``out`` and return ``out``.

    ``scheduler`` (ddim, euler, dpm++) swaps the model reference's scheduler class for a sampler of the
    same noise schedule; by default the reference's own scheduler class and config are kept, with the
    checkpoint's noise schedule (zero terminal SNR and trailing spacing included) and prediction type
    (a zero-terminal-SNR model whose reference class cannot rescale its betas gets DDIM). ``out`` must be new or
    empty; with ``overwrite``, an earlier export there (a diffusers pipeline directory) is written over.
    Everything the user gave is checked before a model loads.
    """
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    checkpoints.check_checkpoint(checkpoint)
    _check_not_source(out, [checkpoint] + ([model_ref] if model_ref else []))
    check_output_dir(out, overwrite)
    if model_ref:  # a wrong reference fails here, in one line, before the checkpoint loads
        loading.resolve_model(model_ref, components=("vae", "text_encoder", "tokenizer", "scheduler"))
    trained = sampling.load_trained(checkpoint, model_ref=model_ref, ema=ema)
    _check_not_source(out, [trained.model_ref])
    space, adapter = trained.description.space(), trained.description.adapter
    if not adapter.pipeline_decodes(space):  # the pipeline would decode other images than we sample
        raise UserError(f"{checkpoint}: the {adapter.class_name} was trained in {space.describe()}, which diffusers' "
                        f"pipeline for it does not decode (it knows no shift factor or no such autoencoder): "
                        f"sample it with python -m diffusion.generate --checkpoint {checkpoint}")
    sampler = sampling.Sampler(trained.description, scheduler=scheduler)
    if scheduler is None and trained.prediction_type:  # DDPM objectives keep the reference's scheduler class
        sampler.scheduler = _reference_scheduler(trained.model_ref, trained.prediction_type,
                                                 trained.noise_schedule)
    pipe = sampler.pipeline(trained.denoiser)
    unet, resolution = getattr(pipe, "unet", None), trained.description.resolution
    if unet is not None and resolution and resolution % pipe.vae_scale_factor == 0:
        # StableDiffusionPipeline draws unet.config.sample_size x the VAE's factor px unless told: the trained size
        unet.register_to_config(sample_size=resolution // pipe.vae_scale_factor)
    pipe.to(dtype=DTYPES[dtype])
    os.makedirs(out, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    conditioning = getattr(pipe, "conditioning", None)
    if conditioning:  # SD3's pipeline leaves its three encoder slots empty: ours goes beside them
        text_encoder, tokenizer = conditioning
        text_encoder.to(dtype=DTYPES[dtype]).save_pretrained(os.path.join(out, "text_encoder"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    described = trained.description
    text_as_trained = described.text_mask or described.text_length != schema.MAX_TOKENS
    guided = dict(described.denoiser_config).get("guidance_embeds")
    if text_as_trained or (unet is None and resolution) or guided:  # where our sampler reads them
        record = {"text_mask": described.text_mask, "text_length": described.text_length, "resolution": resolution}
        if guided:  # the value its guidance embedding read in training (FluxPipeline's default 3.5 is not it)
            record["embedded_guidance"] = trained.denoiser.embedded_guidance
        with open(os.path.join(out, sampling.TEXT_CONDITIONING), "w") as f:
            json.dump(record, f, indent=2)
    if text_as_trained:
        print(f"note: the model was trained on {described.text_length}-token captions"
              + (" with text masks (the denoiser reads the caption's tokens only), which diffusers' pipelines do "
                 "not pass" if described.text_mask else "")
              + f": sample it with python -m diffusion.generate --checkpoint "
              + (f"{out} (it reads {sampling.TEXT_CONDITIONING})" if conditions_as_trained(out, described)
                 else checkpoint) + " to condition it as trained")
    return out


def conditions_as_trained(out: str, described) -> bool:
    """Whether our sampler reads the export ``out`` with the text length and masks ``described`` trained with."""
    again = sampling.text_conditioning(out)
    return (again.get("text_mask", False), again.get("text_length", schema.MAX_TOKENS)) == (
        bool(described.text_mask), int(described.text_length))


def _check_not_source(out: str, sources: list[str]) -> None:
    if any(os.path.abspath(out) == os.path.abspath(os.path.expanduser(src)) for src in sources):
        raise UserError(f"--out {out!r} is where the model comes from; export to a new directory")


def check_output_dir(out: str, overwrite: bool = False) -> None:
    """``out`` is new, an empty directory, or (with ``overwrite``) an earlier export: never a file or a
    directory holding anything else, which ``save_pretrained`` would silently mix with the pipeline."""
    if not os.path.exists(out):
        blocked = cli.file_in_the_way(out)  # before the model loads
        if blocked:
            raise NotADirectoryError(errno.ENOTDIR, "cannot make the folder for --out: a file is in the way", blocked)
        return
    if not os.path.isdir(out):
        raise FileExistsError(errno.EEXIST, "--out exists and is not a directory", out)
    if not os.listdir(out):
        return
    if not os.path.exists(os.path.join(out, "model_index.json")):
        raise FileExistsError(errno.EEXIST, "--out exists and holds files that are not a pipeline; "
                                            "export to a new or empty directory", out)
    if not overwrite:
        raise FileExistsError(errno.EEXIST, "--out already holds a pipeline; pass --overwrite to replace it, "
                                            "or export to a new directory", out)


def _reference_scheduler(model_ref: str, prediction_type: str | None, noise_schedule: dict | None = None):
    """The model reference's scheduler, as its config names it, with the training noise schedule and
    predicting what training predicted; DDIM when that class cannot sample a zero-terminal-SNR schedule."""
    import diffusers
    path = os.path.join(loading.resolve_model(model_ref, components=("scheduler",)), "scheduler")
    with open(os.path.join(path, "scheduler_config.json")) as f:
        config = json.load(f)
    cls = getattr(diffusers, config["_class_name"])
    zero_snr = (noise_schedule or config).get("rescale_betas_zero_snr")
    if zero_snr and not sampling.supports_zero_terminal_snr(cls):
        cls = diffusers.DDIMScheduler
    return sampling.with_training_schedule(cls, config, noise_schedule, prediction_type)


DESCRIPTION = """Export a trained model as a diffusers StableDiffusionPipeline directory.

Input: a checkpoint (a Composer checkpoint written by run.py or diffusion.online, EMA weights unless
--no-ema, or a diffusers pipeline directory) and, for the frozen parts, the model reference it was
trained with (or --model). Output: a new directory in the diffusers layout (unet/ vae/ text_encoder/
tokenizer/ scheduler/ model_index.json, safetensors weights) that
diffusers.StableDiffusionPipeline.from_pretrained(DIR) loads, with the VAE scaling factor, the
prediction type and the noise schedule training used written into its configs. A model trained with
zero terminal SNR (model.zero_terminal_snr) gets a scheduler with rescale_betas_zero_snr=true and
"trailing" timestep spacing; sample it with guidance_rescale=0.7 (diffusion.generate's default for
such models; the pipeline's own default is 0)."""
EXAMPLES = """examples:
  python -m diffusion.export --checkpoint out/demo/checkpoints/latest-rank0.pt --out exported/
  python -m diffusion.export --checkpoint ckpt/ep0-ba550000-rank0.pt --out sd2-256/ --dtype float16 \\
      --scheduler dpm++ --model stabilityai/stable-diffusion-2-base"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m diffusion.export", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, metavar="CKPT",
                        help="Composer checkpoint file (e.g. CKPT_FOLDER/latest-rank0.pt) or diffusers "
                             "pipeline directory")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory (diffusers layout): new or empty, or an earlier export with "
                             "--overwrite")
    parser.add_argument("--overwrite", action="store_true",
                        help="write over an earlier export in --out (never over other files)")
    parser.add_argument("--model", default=None, metavar="REF",
                        help="model reference for the VAE, text encoder, tokenizer and scheduler "
                             "(default: the one the checkpoint was trained with)")
    parser.add_argument("--no-ema", dest="ema", action="store_false", help="export the raw, not the EMA, weights")
    parser.add_argument("--scheduler", choices=sampling.SCHEDULERS, default=None,
                        help="save this sampler instead of the model reference's scheduler class")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="weight precision of the saved pipeline (default: %(default)s)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    out = export_pipeline(args.checkpoint, args.out, model_ref=args.model, ema=args.ema,
                          scheduler=args.scheduler, dtype=args.dtype, overwrite=args.overwrite)
    with open(os.path.join(out, "model_index.json")) as f:
        pipeline_class = json.load(f)["_class_name"]
    adapter = denoisers.adapter(denoisers.resolve_class(out))
    two = loading.pooled_text_slots(out) is not None  # every text encoder in its own slot: prompts as strings
    empty = ", " + ", ".join(f"{slot}=None" for slot in adapter.empty_slots) if adapter.empty_slots and not two else ""
    print(f"wrote {os.path.abspath(out)}: load with diffusers.{pipeline_class}.from_pretrained({out!r}{empty})")
    described = trained_description(args.checkpoint)
    size = described.resolution if described else None
    guided = ""  # a guidance-distilled transformer (Flux.1-dev's shape): the pipeline's default 3.5 is not what it read
    if _config_of(out, adapter).get("guidance_embeds"):
        value = described.embedded_guidance if described and described.embedded_guidance is not None else 1.0
        guided = f", guidance_scale={value:g}"
    if two:
        length = sampling.describe_reference(out).text_length
        at = f", height={size}, width={size}" if size else ""
        print(f"  and call it as trained (its size{'' if size else ' as height= and width='}; diffusers' default is "
              f"1024 px{'; guidance_scale is the value its guidance embedding was trained with' if guided else ''}), "
              f"e.g. pipe(\"a prompt\"{at}, negative_prompt=\"\", {adapter.cfg_argument}=4.0{guided}, "
              f"max_sequence_length={length}).images[0], as diffusion.generate does")
    if empty:
        print(embeddings_call(out, pipeline_class, adapter, size, guided))
    with open(os.path.join(out, "scheduler", "scheduler_config.json")) as f:
        if json.load(f).get("rescale_betas_zero_snr"):
            print(f"zero terminal SNR: call the pipeline with guidance_rescale="
                  f"{sampling.ZTSNR_GUIDANCE_RESCALE} to sample as diffusion.generate does")


def _config_of(out: str, adapter) -> dict:
    """The exported denoiser's config.json ({} where there is none to read)."""
    try:
        with open(os.path.join(out, adapter.component, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def embeddings_call(out: str, pipeline_class: str, adapter, size: int | None, guided: str = "") -> str:
    """How to call an export whose pipeline cannot load our text encoder (its slots left empty): with the
    embeddings :func:`prompt_inputs` makes, at the trained size, as lines that run as written; or, where
    the pipeline cannot pass the text masks the model was trained with, our sampler."""
    import diffusers
    masked = sampling.text_conditioning(out).get("text_mask", False)
    takes_masks = "prompt_attention_mask" in inspect.signature(getattr(diffusers, pipeline_class).__call__).parameters
    if masked and not takes_masks:
        return (f"  (it was trained with text masks, which {pipeline_class} does not pass to the denoiser: "
                f"sample it with python -m diffusion.generate --checkpoint {out})")
    at = f", height={size}, width={size}" if size else ""
    extra = "".join(f", {key}={value!r}" for key, value in adapter.call_kwargs(4.0).items()) + guided
    return (f"  and call it with our text encoder's embeddings ({pipeline_class} cannot load it: prompt_inputs reads "
            f"text_encoder/ and tokenizer/ beside it) at the size it was trained at"
            f"{'' if size else ' (pass it as height= and width=)'}, e.g.\n"
            f"    from diffusion.sample.export import prompt_inputs\n"
            f"    image = pipe(**prompt_inputs(pipe, \"a prompt\"){at}{extra}).images[0]\n"
            f"  or sample it with python -m diffusion.generate --checkpoint {out}")


def prompt_inputs(pipe, prompt: str | list[str], negative_prompt: str = "") -> dict:
    """The prompt arguments of an exported pipeline whose text-encoder slots are empty (SD3's, SANA's):
    ``pipe(**prompt_inputs(pipe, "a prompt"), height=..., width=...)`` draws what ``diffusion.generate``
    draws from the export (same seed, steps and guidance).

    diffusers' pipelines encode prompts with their own encoders (SD3's two CLIPs and T5, SANA's Gemma
    with its instruction), which are not the one the model was trained on: the export saves ours in
    ``text_encoder/`` and ``tokenizer/`` of the directory ``pipe`` was loaded from, and this encodes the
    prompts and the negative prompt with it as training did (its text length, with the attention masks
    and pooled vectors the pipeline takes), on ``pipe``'s device, in its denoiser's dtype.
    """
    adapter = denoisers.adapter_for(pipe.transformer)
    root = pipe.name_or_path
    if getattr(pipe, "conditioning", None) is None:
        if not root or not os.path.isdir(os.path.join(root, "text_encoder")):
            raise UserError(f"{root or 'this pipeline'}: no text_encoder/ beside the pipeline: load the directory "
                            f"python -m diffusion.export wrote with {pipe.__class__.__name__}.from_pretrained")
        pipe.conditioning = (loading.load_text_encoder(root), loading.load_tokenizer(root))
    pipe.conditioning[0].to(pipe.device)
    trained = sampling.text_conditioning(root) if root else {}
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    kwargs = adapter.prompt_kwargs(pipe, prompts, negative_prompt, 0.0, trained.get("text_length", schema.MAX_TOKENS),
                                   trained.get("text_mask", False))
    if "text_masks" in kwargs:
        raise UserError(f"{root}: the model was trained with text masks, which {pipe.__class__.__name__} does not "
                        f"pass to the denoiser: sample it with python -m diffusion.generate --checkpoint {root}")
    dtype = pipe.transformer.dtype
    return {key: value.to(pipe.device, dtype if value.is_floating_point() else value.dtype)
            if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}


def trained_description(checkpoint: str):
    """A Composer checkpoint's model description (read weights-only), or None (a diffusers directory, a file
    that is not a checkpoint of ours)."""
    from diffusion.models import safe_checkpoint
    from diffusion.models.description import ModelDescription
    if os.path.isdir(checkpoint):
        return None
    try:
        state = safe_checkpoint.load(checkpoint, mmap=True).get("state") or {}
        return ModelDescription.from_extra_state(state["model"]["_extra_state"])
    except Exception:  # not a checkpoint of ours: the message says to pass the size
        return None


if __name__ == "__main__":
    cli.run(main, "export")
