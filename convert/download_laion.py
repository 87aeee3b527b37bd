"""Download a LAION-style url+caption list into image shards (img2dataset-compatible), with Ray Data.

    python convert/download_laion.py --input laion/part-00000.parquet --output out/raw
    python convert/download_laion.py --input s3://bucket/urls/ --output out/raw --resize-mode center_crop \
        --image-size 512 --address auto

Re-running the same command resumes: finished shards are skipped. See diffusion/data/download.py.
"""

import argparse

from diffusion.data.download import DownloadConfig, download
from diffusion.data.download_http import FetchConfig
from diffusion.data.download_image import RESIZE_MODES, ImageRules
from diffusion.data.download_input import InputColumns


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="parquet/csv/jsonl file or directory, local or s3://")
    p.add_argument("--output", required=True, help="output directory for NNNNN.parquet + NNNNN_stats.json")
    p.add_argument("--input-format", choices=("parquet", "csv", "jsonl"), help="default: from the extension")
    p.add_argument("--url-col", default="URL")
    p.add_argument("--caption-col", default="TEXT")
    p.add_argument("--keep-columns", default="", help="comma-separated input columns to carry over")
    p.add_argument("--rows-per-shard", type=int, default=10_000)
    p.add_argument("--threads", type=int, default=64, help="concurrent requests per shard")
    p.add_argument("--concurrency", type=int, help="shards in flight (default: from the cluster's CPUs)")
    p.add_argument("--num-cpus", type=float, default=0.25, help="CPUs reserved per shard task")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request attempt")
    p.add_argument("--retries", type=int, default=2, help="retries on timeouts and 5xx")
    p.add_argument("--max-bytes", type=int, default=20 * 2**20)
    p.add_argument("--max-redirects", type=int, default=5)
    p.add_argument("--min-size", type=int, default=64, help="minimum shorter side, pixels")
    p.add_argument("--max-pixels", type=int, default=2**25)
    p.add_argument("--resize-mode", choices=RESIZE_MODES, default="no")
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or a local instance)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    keep = tuple(c.strip() for c in args.keep_columns.split(",") if c.strip())
    config = DownloadConfig(
        input=args.input, output=args.output, input_format=args.input_format,
        columns=InputColumns(args.url_col, args.caption_col, keep), rows_per_shard=args.rows_per_shard,
        threads=args.threads, concurrency=args.concurrency, num_cpus=args.num_cpus,
        fetch=FetchConfig(timeout=args.timeout, retries=args.retries, max_bytes=args.max_bytes,
                          max_redirects=args.max_redirects),
        image=ImageRules(min_size=args.min_size, max_pixels=args.max_pixels, resize_mode=args.resize_mode,
                         image_size=args.image_size))
    if args.address:
        import ray
        ray.init(address=args.address)
    print(download(config))


if __name__ == "__main__":
    main()
