"""Conversion with aspect-ratio buckets vs square crops, on the same input, in one run.

    python bench/bench_buckets.py [--n 256] [--resolution 64] [--kit DIR]

Two measurements, square first then bucketed, each on the same rows:
- the transform alone on one thread (decode, checks, crop; what --buckets changes): images/s;
- the whole conversion (python convert/laion_to_mds.py's run_conversion over the sample data with the
  tiny kit, on a local Ray instance): images/s overall, each run into a fresh output.
Goal: buckets cost at most 1.1x the square conversion's time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import pyarrow.parquet as pq

from diffusion import schema
from diffusion.convert.buckets import bucket_crop, nearest_bucket, preset_buckets
from diffusion.convert.transforms import ImageChecks, Rejected, center_square_crops, decode_image


def transform_rates(jpegs: list[bytes], resolution: int) -> tuple[float, float]:
    checks = ImageChecks(max_aspect=float("inf"))
    buckets = preset_buckets(resolution, 3.0)
    largest = max(max(b) for b in buckets)

    def square(data):
        image, _, _ = decode_image(data, resolution, checks)
        return center_square_crops(image, [resolution])

    def bucketed(data):
        image, w, h = decode_image(data, largest, checks)
        return bucket_crop(image, nearest_bucket(w, h, buckets))

    rates = []
    for fn in (square, bucketed):
        fn(jpegs[0])
        start = time.perf_counter()
        for data in jpegs:
            fn(data)
        rates.append(len(jpegs) / (time.perf_counter() - start))
    return rates[0], rates[1]


def _decodes(data) -> bool:
    """Leave the sample's bad rows (on purpose) out of the transform timing."""
    try:
        decode_image(data, 8)
        return True
    except Rejected:
        return False


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=256, help="rows of sample data")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--kit", default=None, help="model kit (default: build the tiny kit in a temp dir)")
    args = parser.parse_args(argv)

    import ray
    from diffusion.convert.pipeline import ConvertConfig, run_conversion
    from diffusion.kit.build import ensure_kit
    from diffusion.kit.sample import write_sample_data

    tmp = tempfile.mkdtemp(prefix="bench-buckets-")
    kit = args.kit or str(ensure_kit("tiny", os.path.join(tmp, "kit")))
    raw = os.path.join(tmp, "raw")
    write_sample_data(raw, n=args.n, seed=0)
    jpegs = [b for f in sorted(os.listdir(raw)) if f.endswith(".parquet")
             for b in pq.read_table(os.path.join(raw, f), columns=[schema.RAW_IMAGE])[schema.RAW_IMAGE].to_pylist()]
    sq_rate, bk_rate = transform_rates([b for b in jpegs if _decodes(b)], args.resolution)

    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    results = {"square": [0, 0.0], "buckets": [0, 0.0]}
    # A warm-up conversion (Ray's workers start, the kit is read once), then square, buckets, buckets,
    # square: each mode's time summed over a run early and a run late in the sequence.
    for i, name in enumerate(("warmup", "square", "buckets", "buckets", "square")):
        out = os.path.join(tmp, f"{name}-{i}")
        summary = run_conversion(ConvertConfig(input=raw, output=out, model=kit, resolutions=(args.resolution,),
                                               buckets="preset" if name == "buckets" else None, progress=False))
        if name in results:
            results[name][0] += summary.written
            results[name][1] += summary.wall_seconds
    buckets = schema.DatasetInfo.load(os.path.join(tmp, "buckets-2")).buckets

    print(f"rows {args.n}, resolution {args.resolution}, buckets {', '.join(b['name'] + ': ' + str(b['count']) for b in buckets)}")
    print(f"{'':28}{'square':>10}{'buckets':>10}{'time ratio':>12}")
    print(f"{'transform, img/s/thread':28}{sq_rate:>10.1f}{bk_rate:>10.1f}{sq_rate / bk_rate:>11.2f}x")
    (sq_n, sq_s), (bk_n, bk_s) = results["square"], results["buckets"]
    print(f"{'conversion, img/s overall':28}{sq_n / sq_s:>10.1f}{bk_n / bk_s:>10.1f}{(bk_s / bk_n) / (sq_s / sq_n):>11.2f}x")
    print("goal: buckets' time <= 1.1x square")


if __name__ == "__main__":
    main()
