"""Convert raw image-caption data (parquet, webdataset tars, image folders) into MDS shards of VAE
moments and text embeddings.

    python convert/laion_to_mds.py --input IN --output OUT --model REF [--resolutions 256 512] [...]

Re-running the same command after a kill resumes: the output ends up with exactly the samples of a
clean run. All logic lives in diffusion.data.convert.
"""

from __future__ import annotations

import argparse
import sys

from diffusion.data import contract
from diffusion.data.convert import ConvertConfig, OutputMismatchError, run_conversion
from diffusion.data.readers import InputError
from diffusion.models.loading import ModelReferenceError


def parse_args(argv=None) -> ConvertConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", required=True, nargs="+", help="files, directories, globs or s3:// URIs")
    p.add_argument("--output", required=True, help="local directory or s3://bucket/prefix")
    p.add_argument("--model", required=True, help="hub id or diffusers directory (VAE, text encoder, tokenizer)")
    p.add_argument("--resolutions", type=int, nargs="+", default=[256])
    p.add_argument("--limit", type=int, help="read at most this many input rows")
    p.add_argument("--batch-size", type=int, help="encoder batch (default: 120 @256, 40 @512 on GPU; 8 on CPU)")
    p.add_argument("--transform-batch-size", type=int, default=32)
    p.add_argument("--image-column", default=contract.RAW_IMAGE)
    p.add_argument("--caption-column", default=contract.RAW_CAPTION)
    p.add_argument("--key-column", default=contract.RAW_KEY)
    p.add_argument("--min-size", type=int, default=64, help="shortest side in pixels")
    p.add_argument("--max-aspect", type=float, default=3.0, help="long side / short side")
    p.add_argument("--max-pixels", type=int, default=8192 * 8192, help="decompression-bomb guard")
    p.add_argument("--num-transformers", type=int, help="transform actors (default: from the cluster's CPUs)")
    p.add_argument("--cpus-per-transformer", type=float)
    p.add_argument("--num-encoders", type=int, help="encoder actors (default: one per GPU, else 1)")
    p.add_argument("--encoder-gpus", type=float, help="GPUs per encoder actor (default 1 if any)")
    p.add_argument("--accelerator-type", help="Ray accelerator type for encoders, e.g. A10G")
    p.add_argument("--shard-size", default=1 << 26, help="MDS shard size limit (bytes or e.g. 64mb)")
    p.add_argument("--compression", default="zstd", help="MDS compression ('none' to disable)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or local)")
    p.add_argument("--local-dir", help="staging directory for an s3:// output")
    p.add_argument("--visualize", type=int, default=0, metavar="N",
                   help="write visualize.png: N input crops beside VAE decodings of their stored latents")
    p.add_argument("--deterministic", action="store_true",
                   help="same input, same parts in the same order (so the same training order); "
                        "keeps Ray's row order, which can idle workers on a large cluster")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    shard_size = int(a.shard_size) if str(a.shard_size).isdigit() else a.shard_size
    return ConvertConfig(
        input=a.input if len(a.input) > 1 else a.input[0], output=a.output, model=a.model,
        resolutions=tuple(a.resolutions), limit=a.limit, batch_size=a.batch_size,
        transform_batch_size=a.transform_batch_size, image_column=a.image_column,
        caption_column=a.caption_column, key_column=a.key_column, min_size=a.min_size,
        max_aspect=a.max_aspect, max_pixels=a.max_pixels, num_transformers=a.num_transformers,
        cpus_per_transformer=a.cpus_per_transformer, num_encoders=a.num_encoders,
        encoder_gpus=a.encoder_gpus, accelerator_type=a.accelerator_type, shard_size=shard_size,
        compression=None if a.compression == "none" else a.compression, address=a.address,
        local_dir=a.local_dir, visualize=a.visualize, progress=not a.no_progress,
        deterministic=a.deterministic)


def main(argv=None) -> None:
    cfg = parse_args(argv)
    try:
        summary = run_conversion(cfg)
    except (InputError, ModelReferenceError, OutputMismatchError) as e:  # the user's input, not a bug: no traceback
        raise SystemExit(f"laion_to_mds: error: {e}") from e
    except KeyboardInterrupt:  # committed parts are whole; the next run skips them
        print("laion_to_mds: interrupted; re-run the same command to resume", file=sys.stderr)
        raise SystemExit(130) from None
    print(summary.table())


if __name__ == "__main__":
    main()
