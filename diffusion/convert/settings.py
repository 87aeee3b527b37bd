"""The data pipeline's settings, declared once: the converter's flags and online mode's ``data.online``
section are both made of :class:`PipelineSettings` (which columns to read, which images to keep, how the
transform and encode pools are sized), so the two modes cannot drift apart.

Light on purpose (dataclasses only): the training config imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from diffusion import schema
from diffusion.cli import flag

MIN_SIZE = 64  # shortest side, in pixels, of the original image
MAX_ASPECT = 3.0  # long side / short side
MAX_PIXELS = 8192 * 8192  # decompression-bomb guard: checked from the header, before decoding
MAX_BYTES = 20 * 2**20  # largest image file read (the downloader's --max-bytes default)
MAX_SCANS = 100  # most scans a JPEG may have (encoders write 1 to ~20); each one decodes the whole image
MAX_CAPTION_CHARS = 8192  # longest caption kept (the text encoder reads 77 tokens, a few hundred characters)
TRANSFORM_BATCH = 32
SHARD_SIZE = 1 << 26  # bytes of an MDS shard (streaming's default size limit)
RECAPTION_BATCH = 16  # images per captioning call
MAX_NEW_TOKENS = 30  # most tokens a captioning model generates per caption


@dataclasses.dataclass
class PipelineSettings:
    """Read → transform → encode, whatever the destination (MDS shards or training workers)."""

    image_column: str = flag(schema.RAW_IMAGE, "input column with the encoded image bytes")
    caption_column: str = flag(schema.RAW_CAPTION, "input column with the caption")
    key_column: str = flag(schema.RAW_KEY, "input column with a stable row id (else one is derived from "
                                           "the file's path and row)")
    min_size: int = flag(MIN_SIZE, "reject images whose shorter side is smaller (pixels)", type=int)
    max_aspect: float = flag(MAX_ASPECT, "reject images whose long side / short side is larger", type=float)
    max_pixels: int = flag(MAX_PIXELS, "decompression-bomb guard: reject larger images (pixels)", type=int)
    max_bytes: int = flag(MAX_BYTES, "memory-bomb guard: reject larger image files (bytes) unread", type=int)
    max_scans: int = flag(MAX_SCANS, "time-bomb guard: reject JPEGs of more scans, before decoding", type=int)
    max_caption_chars: int = flag(MAX_CAPTION_CHARS, "reject longer captions (characters), untokenized", type=int)
    text_length: int = flag(schema.MAX_TOKENS, "tokens per caption, padded or truncated: 77 for CLIP (its "
                                               "context), e.g. 256 for a T5 text encoder's long captions; each "
                                               "caption's token count is stored beside it (its attention mask)",
                            type=int)
    transform_batch_size: int = flag(TRANSFORM_BATCH, "rows per transform batch", type=int)
    num_transformers: Optional[int] = flag(None, "transform actors (default: from the cluster's CPUs)", type=int)
    cpus_per_transformer: Optional[float] = flag(None, "CPUs per transform actor", type=float)
    encoder_batch_size: Optional[int] = flag(None, "encoder batch (default: 120 @256, 40 @512 on GPU; 8 on CPU)",
                                             type=int, flag_name="--batch-size")
    num_encoders: Optional[int] = flag(None, "encoder actors (default: one per GPU, else 1)", type=int)
    encoder_gpus: Optional[float] = flag(None, "GPUs per encoder actor (default 1 if the cluster has GPUs)",
                                         type=float)
    encoder_accelerator_type: Optional[str] = flag(None, "Ray accelerator type for the encoders, e.g. A10G",
                                                   flag_name="--accelerator-type")
    # Curation from the pixels (issue 51; diffusion.convert.curate, diffusion.convert.exclude)
    embed: Optional[str] = flag(None, "image-text embedding model (hub id or local transformers directory: CLIP, "
                                      "SigLIP; the kit's tiny-clip offline), a stage before encoding: stores "
                                      "clip_score (image-caption cosine) and the heads' scores as columns --where can "
                                      "filter on", metavar="MODEL_REF")
    store_embeddings: bool = flag(False, "--embed: store each image embedding too (column clip_embeds, float16)")
    aesthetic_head: Optional[str] = flag(None, "--embed: aesthetic head on the image embedding (safetensors, LAION "
                                               "aesthetic predictor's layout): column aesthetic_score", metavar="FILE")
    nsfw_head: Optional[str] = flag(None, "--embed: NSFW head on the image embedding (safetensors): column nsfw",
                                    metavar="FILE")
    watermark_head: Optional[str] = flag(None, "--embed: watermark head on the image embedding (safetensors): "
                                               "column watermark", metavar="FILE")
    exclude: Optional[list[str]] = flag(None, "blocklists: text files of keys, URL sha256s (Re-LAION's form: 64 hex "
                                              "digits, or url_sha256:HEX) or image sha256s (image_sha256:HEX), one a "
                                              "line; keys and URLs are dropped as the input is read, image hashes "
                                              "before decoding, counted as 'excluded: key|url|image'",
                                        nargs="+", metavar="FILE")

    def pipeline_settings(self) -> dict:
        """These settings alone, as keyword arguments (to build one config from another)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(PipelineSettings)}
