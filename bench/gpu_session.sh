#!/usr/bin/env bash
# Issue 14's measurements, one device-tool call per part (each meant to fit a call's 10 minutes; the
# times below are estimates, as no GPU has run them yet). From the project root, here:
#   ../shared/gpu/fetch-wheels.sh                      # once: diffusers, Composer, streaming wheels in .whl/
# then, with the device tool:
#   run(command="bash bench/gpu_session.sh train256", carry=[".whl"])   # eager/channels_last/compile, 256 px
#   run(command="bash bench/gpu_session.sh train512", carry=[".whl"])   # the same at 512 px
#   run(command="bash bench/gpu_session.sh text", carry=[".whl"])       # --text embeds vs ids step time, 256 px
#   run(command="bash bench/gpu_session.sh encode", carry=[".whl"])     # SD2 VAE + OpenCLIP-H encode stage
#   run(command="bash bench/gpu_session.sh mmdit", carry=[".whl"])      # SD3-medium MMDiT, unmasked and 75% masked
#   run(command="bash bench/gpu_session.sh product", carry=[".whl", ".cache/kit/sd2-base"])  # issue 52: run.py timed
#       (FSDP eager/compiled, no FSDP; FSDP eager profiled) beside the bench loop, then gpu_checks.py (activations,
#       masked attention). The sd2-base kit has no VAE weights, so the image logger is off. EXTRA is not for this part.
# Each part writes its full log under $OUT (what comes back) and prints the table last. Every bench
# measures the bf16 matmul peak in the same run (bench_train.py --measure-peak) for its MFU.
# PYTHON and EXTRA (more arguments for every bench) may be set, e.g. for a CPU smoke run:
#   PYTHON=.venv/bin/python EXTRA="--tiny --device cpu --steps 2 --warmup 1" bash bench/gpu_session.sh text
set -u
part=${1:?"which part: train256, train512, text, encode, mmdit or product"}
PY=${PYTHON:-python3}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # the GPU image lacks diffusers, Composer and streaming
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site:$PWD
fi
{ date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; } \
  > "$OUT/$part-machine.txt"

bench() {  # bench NAME ARGS...: run one bench, full log under $OUT, its last lines on stdout
  local name=$1; shift
  "$PY" "$@" ${EXTRA:-} > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 20 "$OUT/$name.log"
  echo "[$name: exit $rc]"
}

case $part in
  train256) bench train-256 bench/bench_train.py --resolutions 256 --batch-size 64 --steps 20 --warmup 5 ;;
  train512) bench train-512 bench/bench_train.py --resolutions 512 --batch-size 16 --steps 10 --warmup 3 ;;
  text) bench text-256 bench/bench_train.py --resolutions 256 --batch-size 64 --steps 20 --warmup 5 \
          --variants eager channels_last --text embeds ids ;;
  encode) bench encode bench/bench_encode.py --kit sd2-base --resolutions 256 512 --batches 5 ;;
  mmdit) bench mmdit bench/bench_train.py --denoisers mmdit --resolutions 256 512 --batch-size 32 8 --masked-batch-size 64 32 \
          --variants eager compile --mask-ratio 0.75 --mixer-blocks 2 --steps 10 --warmup 3 ;;
  product) bench product-256 bench/bench_product.py --kit .cache/kit/sd2-base --resolution 256 --batch-size 64 \
            --batches 40 --variants fsdp-eager fsdp-compile eager --profile fsdp-eager --timeout 200 --out "$OUT/product"
           bench checks bench/gpu_checks.py ;;
  *) echo "unknown part $part: train256, train512, text, encode, mmdit or product" >&2; exit 2 ;;
esac
cat "$OUT/$part-machine.txt"
