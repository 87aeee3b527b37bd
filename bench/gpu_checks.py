"""Issue 52's confirmations on a GPU: the meta-device activation count against memory measured on the device,
and attention with and without a boolean text mask at the MMDiT's shapes.

    python bench/gpu_checks.py                        # on a GPU: SD2-base UNet, SD3-medium MMDiT, Flux.1-schnell
    python bench/gpu_checks.py --tiny --device cpu    # smoke run (no memory reading on CPU)

1. **Saved activations per sample.** ``diffusion.train.activation_memory.count_saved`` counts what a training
   forward keeps for backward on the meta device (bf16, fused attention). Here the same denoiser is built on the
   GPU in bf16 at the same shapes, and the bytes allocated across one training forward (less its output), per
   sample, are read with ``torch.cuda.memory_allocated``. The ratio measured / counted says how far the count
   that sizes every YAML's microbatch (BENCHMARKS.md) is from the device.
2. **SDPA with a boolean mask.** fwd+bwd of ``scaled_dot_product_attention`` at SD3-medium's joint sequence
   (1,024 image + 333 text tokens at 512 px, 24 heads of 64), unmasked against a boolean key mask (as
   ``model.text_mask: true`` passes), and which kernels each may use (flash refuses a mask).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

GiB = 2 ** 30


def configs(tiny: bool) -> dict:
    from diffusion.kit.build import FLUX_SCHNELL, SD3_MEDIUM, SD3_TEXT_TOKENS, TINY_FLUX
    from diffusion.models.loading import load_unet_config
    if tiny:
        from bench_train import mmdit_config
        return {"unet (tiny)": (load_unet_config(".cache/kit/tiny"), 8, 77),
                "mmdit (tiny)": (mmdit_config(True), 8, 77),
                "flux (tiny)": (dict(TINY_FLUX, _class_name="FluxTransformer2DModel"), 8, 256)}
    return {"SD2-base UNet": (load_unet_config(".cache/kit/sd2-base"), 32, 77),
            "SD3-medium MMDiT": (dict(SD3_MEDIUM, pooled_projection_dim=SD3_MEDIUM["joint_attention_dim"],
                                      _class_name="SD3Transformer2DModel"), 32, SD3_TEXT_TOKENS),
            "Flux.1-schnell": (dict(FLUX_SCHNELL, _class_name="FluxTransformer2DModel"), 32, 256)}


def measured_saved(adapter, config: dict, latent: int, text_length: int, batch: int, device) -> float | None:
    """Bytes per sample allocated across one bf16 training forward on ``device`` (its output left out)."""
    from diffusion.train.activation_memory import forward_inputs
    with torch.device(device):
        module = adapter.model_class.from_config(config).to(torch.bfloat16)
        sample, timestep, text, pooled = forward_inputs(adapter, config, latent, text_length, adapter.text_dim(config),
                                                        batch)
    module.train()
    sample.requires_grad_(True)
    if device == "cpu":
        with torch.no_grad():
            adapter(module, sample, timestep, text, **pooled)
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = adapter(module, sample, timestep, text, **pooled)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    output = sum(t.numel() * t.element_size() for t in (out if isinstance(out, (tuple, list)) else [out])
                 if isinstance(t, torch.Tensor))
    saved = (after - before - output) / batch
    del out, module
    torch.cuda.empty_cache()
    return saved


def activations(args) -> list[str]:
    from diffusion.models import denoisers
    from diffusion.train.activation_memory import count_saved
    rows = ["| denoiser | latent | text tokens | batch | counted GiB/sample (meta) | measured GiB/sample | measured / counted |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, (config, latent, text_length) in configs(args.tiny).items():
        adapter = denoisers.adapter(config["_class_name"])
        config = {k: v for k, v in config.items() if not k.startswith("_") or k == "_class_name"}
        counted = count_saved(adapter, config, latent, text_length, adapter.text_dim(config)).plain
        try:
            measured = measured_saved(adapter, config, latent, text_length, args.batch, args.device)
        except Exception as e:  # noqa: BLE001 - a row that says why
            measured = None
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
        ratio = f"{measured / counted:.2f}" if measured else "-"
        rows.append(f"| {name} | {latent} | {text_length} | {args.batch} | {counted / GiB:.3f} | "
                    f"{measured / GiB if measured else float('nan'):.3f} | {ratio} |")
        print(rows[-1], flush=True)
    return rows


def attention(args) -> list[str]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    batch, heads, dim = (2, 2, 16) if args.tiny else (8, 24, 64)
    image, text, valid = (16, 8, 4) if args.tiny else (1024, 333, 77 + 20)
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    q, k, v = (torch.randn(batch, heads, image + text, dim, device=args.device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    keep = torch.ones(batch, 1, 1, image + text, dtype=torch.bool, device=args.device)
    keep[..., image + valid:] = False  # padded T5 tokens masked out

    def step(mask):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.sum().backward()

    def timed(mask, backends=None):
        try:
            with sdpa_kernel(backends) if backends else torch.enable_grad():
                for _ in range(3):
                    step(mask)
                if args.device != "cpu":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.attention_steps):
                    step(mask)
                if args.device != "cpu":
                    torch.cuda.synchronize()
                return f"{(time.perf_counter() - start) / args.attention_steps * 1e3:.3f}"
        except RuntimeError as e:
            return f"refused ({str(e).splitlines()[0][:60]})"

    rows = [f"| attention fwd+bwd, {batch}x{heads} heads x {image + text} tokens x {dim} | ms |", "|---|---:|"]
    for label, mask, backends in (("unmasked, any kernel", None, None), ("boolean mask, any kernel", keep, None),
                                  ("unmasked, flash only", None, [SDPBackend.FLASH_ATTENTION]),
                                  ("boolean mask, flash only", keep, [SDPBackend.FLASH_ATTENTION]),
                                  ("boolean mask, efficient only", keep, [SDPBackend.EFFICIENT_ATTENTION])):
        rows.append(f"| {label} | {timed(mask, backends)} |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--attention-steps", type=int, default=20)
    args = p.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(f"device: {device}, torch {torch.__version__}", flush=True)
    rows = attention(args) + [""] + activations(args)
    print("\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
