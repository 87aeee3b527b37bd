"""The converter's checks before any work: the inputs, ``--where`` on their columns, the models' files and
what they can store, and an existing output's settings against this run's. Each refusal is one line naming
the flag or file, and all of them answer before :mod:`diffusion.convert.pipeline` loads Ray, streaming and
the encoders (``python convert/laion_to_mds.py`` with a wrong setting: about 0.3 s of imports, not 12)."""

from __future__ import annotations

import dataclasses
import json
import os

from diffusion import schema
from diffusion.convert.config import ConvertConfig
from diffusion.convert.readers import check_inputs, input_files
from diffusion.convert.where_check import check_where
from diffusion.errors import ConfigError, ModelReferenceError, OutputMismatchError
from diffusion.models import loading

SETTINGS_JSON = "convert.json"  # in the output: the settings its samples were made with


@dataclasses.dataclass
class Preflight:
    """What the checks found, for the conversion to use: where it writes (``out``, the staging folder of a
    remote output), the settings it records, and the models' widths and latent space."""
    out: str
    settings: dict
    text_dim: int
    space: schema.LatentSpace
    pooled_dim: int | None = None
    embed_width: int | None = None


def preflight(cfg: ConvertConfig) -> Preflight:
    """Every check :func:`~diffusion.convert.pipeline.run_conversion` makes before it touches the output;
    raises the one-line error of the first that fails."""
    check_inputs(cfg.input, cfg.raw_columns())
    if cfg.where and cfg.raw_columns().where:  # the rules on the input's columns (those on scores: --embed's)
        check_where(input_files(cfg.input, cfg.raw_columns()), cfg.raw_columns())
    loading.require_weights(cfg.model, ("vae", *loading.text_components(cfg.model)))
    pooled_dim = check_pooled_text(cfg)
    if cfg.recaption is not None:  # found (or fetched) once here, before any actor starts
        from diffusion.convert.recaption import check_captioner
        check_captioner(loading.resolve_captioner(cfg.recaption), cfg.recaption)
    embed_width = None
    if cfg.embed is not None:  # found (or fetched) once here, and its heads checked against its width
        from diffusion.convert.curate import Head, check_embedder
        embed_width = check_embedder(cfg.embed)[1]
        for kind, path in cfg.heads().items():
            Head(path, kind, embed_width)
    text_config = loading.load_text_encoder_config(cfg.model)
    check_text_length(cfg.model, cfg.text_length, text_config)
    space = loading.latent_space_of(loading.load_vae_config(cfg.model))  # what the columns hold
    for r in cfg.resolutions:  # was a ValueError traceback once the pipeline had started
        if r % space.downsample:
            raise ConfigError(f"--resolutions {r}: not a multiple of {space.downsample}, the downsampling of "
                              f"{cfg.model}'s autoencoder; e.g. {max(space.downsample, r // space.downsample * space.downsample)}")
    f = space.downsample  # the encode actors failed on these a minute in (pixel_unshuffle), in a Ray traceback
    off = [f"{w}x{h}" for w, h in cfg.bucket_sizes() or () if w % f or h % f]
    if off:
        raise ConfigError(f"--buckets {cfg.buckets}: {', '.join(off)} not multiples of {f}, the downsampling of "
                          f"{cfg.model}'s autoencoder; give WxH,... with both sides multiples of {f}"
                          + (" (or a --resolutions of at least 256 for the preset)" if cfg.buckets == "preset" else ""))
    out = cfg.staging_dir()
    folder = out
    while not os.path.exists(folder):  # the folders to be made: the first existing one must be one
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):  # was a bare "File exists" / "Not a directory"
        raise ConfigError(f"--output {cfg.output}: not a folder ({folder} is a file); give the folder to write the "
                          f"MDS shards in")
    for given in cfg.input if isinstance(cfg.input, (list, tuple)) else [cfg.input]:
        if os.path.isdir(given) and os.path.realpath(given) == os.path.realpath(out):  # it wrote into the raw data
            raise ConfigError(f"--output {cfg.output} is the --input folder: write the MDS shards to a folder of "
                              f"their own")
    settings = cfg.output_settings()
    # Token counts (text_tokens) are stored since the text length became a setting; an output begun
    # before goes on without them, so its parts all have one set of columns.
    recorded = recorded_settings(out)
    settings["text_tokens"] = bool(recorded.get("text_tokens", False)) if recorded else True
    check_output_settings(out, settings)
    return Preflight(out, settings, loading.text_encoder_width(text_config), space, pooled_dim, embed_width)


def recorded_settings(out: str) -> dict:
    """The settings an existing output was made with ({} for a new or empty one).

    Outputs written before ``convert.json`` existed are described by their ``dataset.json``.
    """
    path = os.path.join(out, SETTINGS_JSON)
    if os.path.exists(path):
        try:
            with open(path) as f:
                return {"key_scheme": 1, **json.load(f)}  # written before keys were derived from paths
        except (ValueError, TypeError) as e:
            raise OutputMismatchError(
                f"{path} is damaged ({e}): it records the settings {out} was converted with, so a re-run can "
                f"check it resumes with the same ones. Restore it, or delete it to resume without that check"
            ) from None
    if os.path.exists(os.path.join(out, schema.DATASET_JSON)):
        try:
            info = schema.DatasetInfo.load(out)
        except (ValueError, TypeError) as e:
            raise OutputMismatchError(f"{os.path.join(out, schema.DATASET_JSON)} is damaged ({e}); delete it and "
                                      f"re-run: it is rewritten at the end of the conversion") from None
        model = info.model
        if os.path.isdir(model):
            model = os.path.abspath(model)
        return {"model": model, "resolutions": info.resolutions, "key_scheme": 1, "text_tokens": info.has_tokens,
                "text_length": info.text_length,
                **{k: info.extra[k] for k in ("min_size", "max_aspect", "max_pixels") if k in info.extra}}
    return {}


def check_output_settings(out: str, settings: dict) -> None:
    """Refuse to add to an output made with other settings, before anything in it is touched."""
    recorded = recorded_settings(out)
    if recorded:  # recorded before these settings existed: made without them
        recorded = {"where": None, "dedupe": "none", "text": schema.TEXT_BOTH, "buckets": None, "captions": [],
                    "recaption": None, "text_length": schema.MAX_TOKENS, "text_tokens": False,
                    "embed": None, "dedupe_threshold": None, "exclude": None,
                    "limit": None, **recorded}  # --dedupe near/semantic decided over the whole input then
    differ = [k for k in settings if k in recorded and recorded[k] != settings[k]]
    if differ:
        what = "; ".join(f"{k}: output has {recorded[k]!r}, this run asks for {settings[k]!r}" for k in differ)
        why = (f" --dedupe {settings['dedupe']} decided its duplicates among the rows --limit read (None: all of "
               f"them), so another --limit would need another decision." if "limit" in differ else "")
        raise OutputMismatchError(
            f"{out} was converted with other settings ({what}).{why} A re-run resumes a conversion only with "
            f"the same settings: repeat them, or write to a new --output.")




def check_pooled_text(cfg: ConvertConfig) -> int | None:
    """The width of the pooled vector stored beside the embeddings where ``cfg.model`` has Flux's two text
    encoders (None: one encoder); what they cannot store yet is refused in one line naming the option."""
    unencoded = loading.unencoded_text_slots(cfg.model)
    if unencoded:  # SD3's layout converted silently with its first CLIP only (768 wide, no pooled vector, no T5)
        sd3 = ": SD3's layout" if "text_encoder_3" in unencoded else ""
        raise ConfigError(f"--model {cfg.model}: its model_index.json names {len(unencoded) + 1} text encoders "
                          f"(text_encoder, {', '.join(unencoded)}{sd3}), and the converter encodes one (or Flux's "
                          f"two), so the others would be left out; pass a model reference with one text encoder in "
                          f"text_encoder/ (the kit layout, e.g. the tiny-mmdit kit's) or Flux's two")
    width = loading.pooled_text_width(cfg.model)
    if width is None:
        return None
    two = f"{cfg.model} has two text encoders (Flux's layout: T5's sequence and CLIP's pooled vector)"
    if cfg.text == schema.TEXT_IDS_ONLY:
        raise ConfigError(f"--text ids: {two}, and training encodes one text encoder's ids only: convert with "
                          f"--text embeds (or both)")
    if cfg.extra_captions():
        raise ConfigError(f"--captions: {two}, and further captions store no pooled vector yet: convert one caption")
    return width


# Longest text a T5 is given where its tokenizer states no model_max_length: T5's relative positions
# have no hard end, but its attention holds heads x L^2 floats per caption (T5-XXL: 4.3 GB at 4096).
MAX_T5_TOKENS = 4096
_NO_LIMIT = 10 ** 12  # transformers writes model_max_length=1e30 (VERY_LARGE_INTEGER) where none was set


def text_length_limit(model: str, text_config: dict) -> tuple[int, str]:
    """(most tokens ``model``'s text encoder reads, where that number comes from): CLIP's learned
    positions (``max_position_embeddings``); for a T5, its tokenizer's ``model_max_length`` (the length
    it was made for), else :data:`MAX_T5_TOKENS`."""
    if loading.text_encoder_type(text_config) == loading.CLIP_TEXT:
        limit = text_config.get("max_position_embeddings")
        return (int(limit), "its max_position_embeddings") if limit else (_NO_LIMIT, "")
    try:
        with open(os.path.join(loading.component_path(model, loading.text_slots(model)[1]), "tokenizer_config.json")) as f:
            stated = json.load(f).get("model_max_length")
    except (OSError, ValueError, AttributeError, ModelReferenceError):
        stated = None  # no tokenizer config to read: loading the tokenizer later names the problem
    if isinstance(stated, (int, float)) and 2 <= stated < _NO_LIMIT:
        return int(stated), "its tokenizer's model_max_length"
    return MAX_T5_TOKENS, "the limit for a T5 whose tokenizer states none"


def check_text_length(model: str, text_length: int, text_config: dict | None = None,
                      name: str = "--text-length") -> None:
    """``text_length`` within what ``model``'s text encoder can read (:func:`text_length_limit`), in one
    line before Ray starts: CLIP has learned positions for its context only, and a T5's attention grows
    with the square of the length. ``name`` is the setting as the user wrote it."""
    text_config = text_config if text_config is not None else loading.load_text_encoder_config(model)
    limit, source = text_length_limit(model, text_config)
    if text_length <= limit:
        return
    if loading.text_encoder_type(text_config) == loading.CLIP_TEXT:
        raise ConfigError(f"{name} {text_length}: the text encoder of {model} is CLIP, which reads at most {limit} "
                          f"tokens; use a T5 text encoder for longer captions")
    raise ConfigError(f"{name} {text_length}: the text encoder of {model} ({text_config.get('model_type')}) reads at "
                      f"most {limit} tokens ({source}); give {name} {limit} or less")
