"""The converter's settings, one per flag of ``python convert/laion_to_mds.py``: :class:`ConvertConfig`.

Light on purpose, like :mod:`diffusion.convert.settings` (whose :class:`PipelineSettings` it extends):
the command parses and checks them before Ray, torch or any model loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile

from diffusion import schema
from diffusion.cli import flag
from diffusion.convert.dedupe import MODES as DEDUPE_MODES
from diffusion.convert.files import RawColumns
from diffusion.convert.rows import KEY_SCHEME
from diffusion.convert.settings import MAX_NEW_TOKENS, RECAPTION_BATCH, SHARD_SIZE, PipelineSettings
from diffusion.errors import ConfigError
from diffusion.where import parse_where


def _size(value: str) -> int | str:
    """``--shard-size``: bytes, or a size streaming parses (``64mb``)."""
    return int(value) if str(value).isdigit() else value


@dataclasses.dataclass(kw_only=True)
class ConvertConfig(PipelineSettings):
    """The converter's settings; each is also its command-line flag (``--field-name``). The pipeline's
    own (columns, image checks, pools) are :class:`PipelineSettings`, shared with online mode."""

    input: str | list[str] = flag(help="raw data: a folder img2dataset wrote (parquet, webdataset, files or "
                                       "tfrecord format; the metadata parquets beside tars and folders are not read as "
                                       "data), or images with .txt captions (files, directories, globs or "
                                       "s3:// URIs)", nargs="+")
    output: str = flag(help="local directory or s3://bucket/prefix for the MDS shards")
    model: str = flag(help="hub id or diffusers directory with the VAE, text encoder and tokenizer")
    resolutions: tuple[int, ...] = flag((256,), "square crop sizes to encode, e.g. 256 512", type=int, nargs="+")
    limit: int | None = flag(None, "read at most this many input rows", type=int)
    shard_size: int | str = flag(SHARD_SIZE, "MDS shard size limit (bytes, or e.g. 64mb)", type=_size)
    compression: str | None = flag("zstd", "MDS compression ('none' to disable)")
    address: str | None = flag(None, "Ray cluster address (default: RAY_ADDRESS or a local instance)")
    local_dir: str | None = flag(None, "staging directory for an s3:// output (stable across re-runs)")
    visualize: int = flag(0, "write visualize.png: N input crops beside VAE decodings of their stored latents",
                          type=int, metavar="N")
    progress: bool = flag(True, "hide the progress line (rows done, written, rejected, rate, ETA: redrawn each "
                                "second on a terminal, a line a minute to a log)")
    deterministic: bool = flag(False, "same input, same parts in the same order (so the same training order); "
                                      "keeps Ray's row order, which can idle workers on a large cluster")
    where: str | None = flag(None, "keep only parquet rows whose metadata passes this filter, decided before any "
                                   "image is decoded, e.g. \"aesthetic >= 5.0 and punsafe < 0.1\" (comparisons, and, "
                                   "or, not, parentheses, in [...], is null); each and-term's removals are counted "
                                   "as 'filtered: TERM'", metavar="EXPR")
    text: str = flag(schema.TEXT_EMBEDS_ONLY, "what the shards hold of the caption: 'embeds' the text encoder's "
                                              "output (training reads it), 'ids' the 77 token ids only (308 B where "
                                              "SD2's embeddings take 158 KB; training runs the text encoder), 'both'",
                     choices=schema.TEXT_STORAGE)
    dedupe: str = flag("none", "bytes: drop exact duplicate images (the same bytes) but their first copy in input "
                               "order, as duplicate_image rejects: a pass over the input before converting; near: "
                               "perceptual near-duplicates (re-encoded, resized, slightly cropped, mirrored, colour-"
                               "jittered: near_duplicate); semantic: SemDeDup on the --embed embeddings "
                               "(semantic_duplicate); near and semantic keep the highest clip_score of a group "
                               "(the first in input order without --embed), in a first pass that decodes and embeds",
                       choices=DEDUPE_MODES)
    dedupe_threshold: float | None = flag(None, "--dedupe near/semantic: cosine similarity at or above which two "
                                                "images are duplicates (default: near 0.9, semantic 0.95)",
                                          type=float, metavar="T")
    visualize_duplicates: int = flag(0, "--dedupe near/semantic: write duplicates.png, N removed groups each beside "
                                        "the image kept", type=int, metavar="N")
    buckets: str | None = flag(None, "aspect-ratio buckets: 'preset' (sides multiples of 64 at the pixel budget of the "
                                     "one --resolutions value, within --max-aspect) or WxH,WxH,...; each image is cropped "
                                     "minimally to the bucket nearest its aspect ratio, one MDS dataset per bucket "
                                     "under --output", metavar="preset|WxH,...")
    captions: str | None = flag(None, "several captions per image: the input's caption columns, comma-separated, e.g. "
                                      "caption,recap_llava (the first is --caption-column); each further one is stored "
                                      "as caption_NAME and encoded (or tokenized) as the first; an empty one is kept "
                                      "and counted; training draws one per sample (data.train.captions)",
                                metavar="NAME,...")
    recaption: str | None = flag(None, "caption every image again with this image-to-text model (hub id or local "
                                       "transformers directory: BLIP, Florence-2, LLaVA, ...; the kit's tiny-captioner "
                                       "offline): a GPU (else CPU) actor stage before encoding whose text is stored "
                                       "and encoded as one more caption (caption_NAME, --recaption-column names it; training draws it with data.train.captions)",
                                 metavar="MODEL_REF")
    recaption_column: str = flag(schema.RECAPTION, "--recaption: name of the new caption column")
    recaption_batch_size: int = flag(RECAPTION_BATCH, "--recaption: images per generate call", type=int)
    recaption_actors: int | None = flag(None, "--recaption: captioning actors (default: half the GPUs, at least 1; "
                                              "1 without GPUs)", type=int)
    recaption_max_tokens: int = flag(MAX_NEW_TOKENS, "--recaption: most tokens generated per caption", type=int)
    recaption_prompt: str | None = flag(None, "--recaption: text given to the model with each image, for models "
                                              "that take an instruction (Florence-2: '<MORE_DETAILED_CAPTION>'; "
                                              "LLaVA: its chat prompt); an echoed prompt is cut from the caption")

    def __post_init__(self):
        if isinstance(self.input, (list, tuple)) and len(self.input) == 1:
            self.input = self.input[0]
        if self.compression in ("none", ""):
            self.compression = None
        self.resolutions = tuple(sorted({int(r) for r in self.resolutions}))
        if not self.resolutions or min(self.resolutions) <= 0:
            raise ConfigError(f"--resolutions must be positive, got {self.resolutions}")
        if max(self.resolutions) ** 2 > self.max_pixels:  # 100000 hung its transform actors for minutes
            r = max(self.resolutions)
            raise ConfigError(f"--resolutions {r}: a {r}x{r} crop is {r * r:,} pixels, more than --max-pixels "
                              f"{self.max_pixels:,}, the largest image the converter reads")
        if self.limit is not None and self.limit <= 0:
            raise ConfigError(f"--limit must be positive, got {self.limit}")
        if not self.max_aspect >= 1:  # nan passed "< 1" and rejected nothing
            raise ConfigError(f"--max-aspect must be >= 1, got {self.max_aspect}")
        for name in ("max_bytes", "max_scans", "max_caption_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name, flag_name in (("transform_batch_size", "transform-batch-size"), ("num_transformers", "num-transformers"),
                                ("cpus_per_transformer", "cpus-per-transformer"), ("encoder_batch_size", "batch-size"),
                                ("num_encoders", "num-encoders")):  # was a Ray traceback, or 0 taken as the default
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"--{flag_name} must be positive, got {getattr(self, name)}")
        if self.encoder_gpus is not None and not self.encoder_gpus >= 0:
            raise ConfigError(f"--encoder-gpus must be >= 0 (0: encode on CPUs), got {self.encoder_gpus}")
        if self.where is not None:
            parse_where(self.where)  # a malformed filter fails here, showing it
        if self.text not in schema.TEXT_STORAGE:
            raise ConfigError(f"--text must be one of {', '.join(schema.TEXT_STORAGE)}, got {self.text!r}")
        if self.text_length < 2:
            raise ConfigError(f"--text-length must be at least 2 (a caption's start and end tokens), got "
                              f"{self.text_length}")
        if self.dedupe not in DEDUPE_MODES:
            raise ConfigError(f"--dedupe must be one of {', '.join(DEDUPE_MODES)}, got {self.dedupe!r}")
        try:
            self.extra_captions()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.buckets is not None:
            self.bucket_sizes()  # a malformed list fails here, naming it
            if self.visualize:
                raise ConfigError("--visualize is for square outputs: leave it out with --buckets")
        if self.recaption is not None:
            self._check_recaption()
        self._check_curation()

    def _check_curation(self) -> None:
        if self.embed is None:
            given = [f for f in ("aesthetic_head", "nsfw_head", "watermark_head", "store_embeddings") if getattr(self, f)]
            if given:
                raise ConfigError(f"--{given[0].replace('_', '-')} reads the image embeddings: give --embed MODEL_REF")
            if self.dedupe == "semantic":
                raise ConfigError("--dedupe semantic clusters the image embeddings: give --embed MODEL_REF")
        if self.dedupe_threshold is not None:
            if self.dedupe not in ("near", "semantic"):
                raise ConfigError("--dedupe-threshold is for --dedupe near or semantic")
            if not 0 < self.dedupe_threshold <= 1:
                raise ConfigError(f"--dedupe-threshold is a cosine similarity in (0, 1], got {self.dedupe_threshold}")
        if self.visualize_duplicates < 0:
            raise ConfigError(f"--visualize-duplicates must be >= 0, got {self.visualize_duplicates}")
        if self.visualize_duplicates and self.dedupe not in ("near", "semantic"):
            raise ConfigError("--visualize-duplicates draws what --dedupe near or semantic removed: give one")
        if self.where:
            scores = self.split_where()[1]  # a rule mixing scores and input columns fails here, naming it
            if scores:  # as the input's are against their files: a score compared with text fails here
                from diffusion.convert.curate import check_score_types
                check_score_types(scores)
        for path in self.exclude or ():
            if not os.path.isfile(os.path.expanduser(path)):
                raise ConfigError(f"--exclude {path}: no such file")

    def computed_columns(self) -> tuple[str, ...]:
        """The score columns this run computes (--embed and its heads), which --where may filter on."""
        if self.embed is None:
            return ()
        from diffusion.convert.curate import CLIP_SCORE, HEAD_COLUMNS
        return (CLIP_SCORE, *(c for kind, c in HEAD_COLUMNS.items() if getattr(self, f"{kind}_head")))

    def split_where(self) -> tuple[str | None, str | None]:
        """(--where's rules on the input's columns, its rules on computed scores)."""
        from diffusion.convert.curate import split_where
        return split_where(self.where, self.computed_columns())

    def heads(self) -> dict:
        return {kind: os.path.abspath(os.path.expanduser(getattr(self, f"{kind}_head")))
                for kind in ("aesthetic", "nsfw", "watermark") if getattr(self, f"{kind}_head")}

    def threshold(self) -> float | None:
        """The --dedupe near/semantic threshold (its default where not given)."""
        if self.dedupe not in ("near", "semantic"):
            return None
        from diffusion.convert.neardup import DEFAULT_THRESHOLDS
        return self.dedupe_threshold if self.dedupe_threshold is not None else DEFAULT_THRESHOLDS[self.dedupe]

    def curation_settings(self) -> dict | None:
        """What decides the computed scores (None without --embed); dataset.json records it too."""
        if self.embed is None:
            return None
        ref = self.embed
        model = os.path.abspath(os.path.expanduser(ref)) if os.path.isdir(os.path.expanduser(ref)) else ref
        return {"model": model, "heads": self.heads(), "store_embeddings": self.store_embeddings}

    def _check_recaption(self) -> None:
        for name in ("recaption_batch_size", "recaption_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.recaption_actors is not None and self.recaption_actors < 1:
            raise ConfigError(f"--recaption-actors must be positive, got {self.recaption_actors}")
        column = self.recaption_column
        try:
            schema.check_caption_name(column, "--recaption-column")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if column in (schema.CAPTION, self.caption_column, *self.input_captions()):
            raise ConfigError(f"--recaption-column {column!r}: the input's captions already take that name "
                              f"(--caption-column, --captions); choose another")

    def bucket_sizes(self) -> list[tuple[int, int]] | None:
        """The (width, height) buckets ``--buckets`` names, or None for square crops."""
        from diffusion.convert.buckets import parse_buckets
        return parse_buckets(self.buckets, self.resolutions, self.max_aspect) if self.buckets else None

    def extra_captions(self) -> tuple[str, ...]:
        """Every caption beyond the first (``--caption-column``, named ``caption``): the input's
        (``--captions``), then the one ``--recaption`` writes."""
        return self.input_captions() + ((self.recaption_column,) if self.recaption is not None else ())

    def input_captions(self) -> tuple[str, ...]:
        """The captions ``--captions`` reads from the input beside the first one."""
        names = [n.strip() for n in (self.captions or "").split(",") if n.strip()]
        if self.captions is not None and not names:  # "--captions ,," or "": a list that lost its names
            raise ValueError(f"--captions {self.captions!r} names no column: give the input's caption columns, "
                             f"comma-separated (e.g. caption,recap), or leave the flag out")
        if len(set(names)) != len(names):
            raise ValueError(f"--captions {self.captions}: a caption is named twice")
        return tuple(schema.check_caption_name(n) for n in names if n not in (schema.CAPTION, self.caption_column))

    def raw_columns(self) -> RawColumns:
        return RawColumns(image=self.image_column, caption=self.caption_column, key=self.key_column,
                          where=self.split_where()[0] if self.where else None, max_bytes=self.max_bytes, max_caption_chars=self.max_caption_chars,
                          captions=self.input_captions(), exclude_urls=self._exclude_urls())

    def _exclude_urls(self) -> frozenset:
        if not self.exclude:
            return frozenset()
        from diffusion.convert.exclude import load_blocklists
        return load_blocklists(self.exclude).urls

    def output_settings(self) -> dict:
        """The settings that decide what a sample holds or whether a row is kept: a re-run into an
        existing output must match them, or its new parts would not belong with the old ones."""
        model = os.path.abspath(os.path.expanduser(self.model)) if os.path.isdir(self.model) else self.model
        settings = {"model": model, "resolutions": list(self.resolutions), "image_column": self.image_column,
                    "caption_column": self.caption_column, "key_column": self.key_column,
                    "min_size": self.min_size, "max_aspect": float(self.max_aspect), "max_pixels": self.max_pixels,
                    "max_bytes": self.max_bytes, "max_scans": self.max_scans,
                    "max_caption_chars": self.max_caption_chars,
                    "key_scheme": KEY_SCHEME, "where": parse_where(self.where).text if self.where else None,
                    "dedupe": self.dedupe, "text": self.text, "text_length": self.text_length,
                    "buckets": [list(b) for b in self.bucket_sizes()] if self.buckets else None,
                    "captions": list(self.input_captions()),
                    "recaption": self.recaption_settings(), "embed": self.curation_settings(),
                    "dedupe_threshold": self.threshold(), "exclude": self.exclude_settings()}
        if self.dedupe in ("near", "semantic"):  # decided over the rows --limit reads: another limit, another
            settings["limit"] = self.limit  # decision (without those, a re-run may change --limit)
        return settings

    def exclude_settings(self) -> list | None:
        """The blocklists (path, size, modification time): another list is another set of rows."""
        if not self.exclude:
            return None
        out = []
        for path in self.exclude:
            path = os.path.abspath(os.path.expanduser(path))
            stat = os.stat(path)
            out.append([path, stat.st_size, stat.st_mtime_ns])
        return out

    def recaption_settings(self) -> dict | None:
        """What decides the generated captions (None without --recaption); dataset.json records it too."""
        if self.recaption is None:
            return None
        ref = self.recaption
        model = os.path.abspath(os.path.expanduser(ref)) if os.path.isdir(os.path.expanduser(ref)) else ref
        return {"model": model, "column": self.recaption_column, "prompt": self.recaption_prompt,
                "max_tokens": self.recaption_max_tokens}

    @property
    def is_remote(self) -> bool:
        return "://" in self.output

    def staging_dir(self) -> str:
        """Where parts are written: the output itself, or a local directory stable across re-runs."""
        if not self.is_remote:
            return os.path.abspath(os.path.expanduser(self.output))
        if self.local_dir:
            return os.path.abspath(self.local_dir)
        digest = hashlib.sha1(self.output.encode()).hexdigest()[:12]
        return os.path.join(tempfile.gettempdir(), "laion_to_mds", digest)
