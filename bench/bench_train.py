"""Training throughput of the denoisers: images/s/GPU and MFU at 256 and 512, bf16, with/without channels_last/compile.

    python bench/bench_train.py                               # full SD2-base UNet, on the GPU
    python bench/bench_train.py --denoisers unet mmdit        # and SD3-medium's MMDiT beside it (issue 26)
    torchrun --nproc_per_node 8 bench/bench_train.py --fsdp   # FSDP over the node
    python bench/bench_train.py --tiny --device cpu           # smoke run of the tiny UNet (CPU)
    python bench/bench_train.py --text embeds ids             # also: text encoded in the step (--text ids data)

One step = denoiser forward on noised latents + MSE on the noise + backward + AdamW, on synthetic
latents and text embeddings (the data path has its own benchmark). ``--denoisers mmdit`` times SD3-medium's
MMDiT at its published shapes (16-channel latents, 77 + 256 text tokens of 4096; FLOPs counted with torch's
FlopCounterMode: 2,529 GFLOP at 256, 6,322 at 512), or with ``--tiny`` the tiny-mmdit kit's. MFU = training FLOPs per image
(539 GFLOP at 256 and 2,409 at 512 for SD2-base, DESIGN.md; counted with torch's FlopCounterMode for
other configs) x images/s / peak, two ways in every table: MFU (spec) against the data sheet's dense bf16
peak (A100 312, H100 989 TFLOP/s; --peak-tflops), as MosaicML's anchors and Composer's SpeedMonitor report
it, and MFU (meas.) against the peak an 8192^3 bf16 matmul reaches in the same run (--measure-peak).
Ends with the headline: best MFU (spec) at each resolution against the anchors (MosaicML 24% / 28%).

``--text ids`` runs each step as training from a dataset of token ids does: the frozen text encoder
(the kit's config, random weights; :class:`diffusion.models.text_encoder.FrozenTextEncoder`, bf16 on a
GPU) encodes the batch's ids before the UNet. With ``--text embeds ids`` every variant is timed both ways
in the same run, and the table adds the step-time ratio ids / embeds; MFU counts the UNet's FLOPs only.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from diffusion.models.flops import measure_peak_tflops, spec_peak_tflops  # noqa: E402
from diffusion.models.loading import load_unet_config  # noqa: E402

SD2_GFLOP_PER_IMAGE = {256: 539.0, 512: 2409.0}  # fwd+bwd, UNet only (DESIGN.md)
ANCHOR_MFU = {256: 0.24, 512: 0.28}  # MosaicML diffusion on A100, against its data-sheet 312 TFLOP/s


DENOISERS = {"unet": "UNet2DConditionModel", "mmdit": "SD3Transformer2DModel"}


def adapter_of(config: dict):
    from diffusion.models import denoisers
    return denoisers.adapter(config.get("_class_name") or "UNet2DConditionModel")


def text_shape(config: dict) -> tuple[int, int]:
    """(tokens, width) of the text states the denoiser of ``config`` attends to."""
    if adapter_of(config).class_name == "SD3Transformer2DModel":
        return config.get("_text_tokens", 77), config["joint_attention_dim"]
    return 77, config["cross_attention_dim"]


def build_unet(config: dict, device="cpu"):
    """The denoiser of ``config`` (a UNet, or an MMDiT with ``_class_name``), random weights."""
    model_class = adapter_of(config).model_class
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device(device):
        return model_class.from_config(config)


def synthetic_batch(config: dict, batch: int, resolution: int, device, factor: int = 8):
    h = resolution // factor
    tokens, width = text_shape(config)
    latents = torch.randn(batch, config["in_channels"], h, h, device=device)
    text = torch.randn(batch, tokens, width, device=device)
    timesteps = torch.randint(0, 1000, (batch,), device=device)
    return latents, text, timesteps


def frozen_text_encoder(kit: str, device):
    """The kit's text encoder (config only: random weights), frozen, as training from ids runs it."""
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffusion.models.text_encoder import FrozenTextEncoder
    config = CLIPTextConfig.from_pretrained(os.path.join(kit, "text_encoder"))
    torch.manual_seed(0)
    return FrozenTextEncoder(CLIPTextModel(config), kit)


def masked_keep(config: dict, batch: int, resolution: int, ratio: float, device, factor: int = 8):
    """A masked step's kept patches per sample (the loader's PatchMask draw), or None without masking."""
    if not ratio:
        return None
    from diffusion.models.masking import PatchMask
    mask = PatchMask(ratio, config["patch_size"])
    shape = (config["in_channels"], resolution // factor, resolution // factor)
    generator = torch.Generator().manual_seed(0)
    return torch.stack([mask(shape, generator) for _ in range(batch)]).to(device)


def train_step(unet, optimizer, batch, autocast, text_encoder=None, keep=None, mixer_blocks=0):
    latents, text, timesteps = batch
    if text_encoder is not None:  # text holds token ids: encode them in the step
        text = text_encoder(text)
    noise = torch.randn_like(latents)
    with autocast:
        adapter = adapter_of({"_class_name": type(getattr(unet, "_orig_mod", unet)).__name__})
        pred = adapter(unet, latents + noise, timesteps, text, keep=keep, mixer_blocks=mixer_blocks)
        if keep is not None:  # the loss over the kept patches, as training takes it
            mask = adapter.loss_mask(getattr(unet, "_orig_mod", unet), keep, latents.shape)
            loss = ((pred.float() - noise) ** 2 * mask).sum() / (mask.sum() * latents.shape[1])
        else:
            loss = torch.nn.functional.mse_loss(pred.float(), noise)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def count_gflop_per_image(config: dict, resolution: int, mask_ratio: float = 0.0, mixer_blocks: int = 0) -> float:
    """Forward+backward FLOPs of one image, counted on the meta device (no compute, no memory); with
    ``mask_ratio`` the masked step's, as it runs."""
    from torch.utils.flop_counter import FlopCounterMode
    unet = build_unet(config, device="meta")
    batch = synthetic_batch(config, 1, resolution, "meta")
    keep = masked_keep(config, 1, resolution, mask_ratio, "meta")
    counter = FlopCounterMode(display=False)
    with counter:
        pred = adapter_of(config)(unet, batch[0], batch[2], batch[1], keep=keep, mixer_blocks=mixer_blocks)
        pred.float().pow(2).mean().backward()
    return counter.get_total_flops() / 1e9


def wrap_fsdp(unet):
    # FSDP2 per block (the adapter's blocks, as training wraps them), then the root.
    from torch.distributed.fsdp import fully_shard
    blocks = adapter_of({"_class_name": type(unet).__name__}).blocks
    for module in [m for m in unet.modules() if type(m).__name__ in blocks]:
        fully_shard(module)
    return fully_shard(unet)


def bench_one(config, resolution, batch_size, device, *, channels_last, compile_, fsdp, steps, warmup,
              text_encoder=None, mask_ratio=0.0, mixer_blocks=0):
    torch.manual_seed(0)
    unet = build_unet(config, device=device).train()
    if channels_last:
        unet = unet.to(memory_format=torch.channels_last)
    if fsdp:
        unet = wrap_fsdp(unet)
    model = torch.compile(unet) if compile_ else unet
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, fused=device.type == "cuda")
    batch = synthetic_batch(config, batch_size, resolution, device)
    if text_encoder is not None and text_shape(config)[1] != text_encoder.model.config.hidden_size:
        raise SystemExit("--text ids: the kit's text encoder is not this denoiser's text width")
    if text_encoder is not None:  # token ids in place of embeddings
        vocab = int(text_encoder.model.config.vocab_size)
        batch = (batch[0], torch.randint(0, vocab, (batch_size, 77), device=device), batch[2])
    if channels_last:
        batch = (batch[0].contiguous(memory_format=torch.channels_last), *batch[1:])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    masking = {"keep": masked_keep(config, batch_size, resolution, mask_ratio, device), "mixer_blocks": mixer_blocks}
    for _ in range(warmup):
        train_step(model, optimizer, batch, autocast, text_encoder, **masking)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        loss = train_step(model, optimizer, batch, autocast, text_encoder, **masking)
    sync()
    seconds = time.perf_counter() - start
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss in the benchmark at {resolution}px")
    return batch_size * steps / seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kit", help="a diffusers-layout model dir (default: the sd2-base kit, or tiny with --tiny)")
    p.add_argument("--tiny", action="store_true", help="the tiny UNet (CPU smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--resolutions", type=int, nargs="+", help="default 256 512 (64 128 with --tiny)")
    p.add_argument("--batch-size", type=int, nargs="+", help="per-GPU batch per resolution (default 64 256px, 16 512px; 2 tiny)")
    p.add_argument("--variants", nargs="+", help="eager channels_last compile channels_last+compile (default: all; "
                   "eager and channels_last with --tiny)")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (run under torchrun)")
    p.add_argument("--text", nargs="+", default=["embeds"], choices=["embeds", "ids"],
                   help="conditioning: stored embeddings, and/or token ids encoded in the step (default embeds)")
    p.add_argument("--denoisers", nargs="+", default=["unet"], choices=list(DENOISERS),
                   help="unet: the kit's UNet (SD2-base); mmdit: SD3-medium's MMDiT (the tiny-mmdit kit's with "
                        "--tiny), timed in the same run (default: unet)")
    p.add_argument("--mask-ratio", type=float, default=0.0,
                   help="also time the MMDiT's masked step (model.masking.ratio, e.g. 0.75) beside the unmasked one "
                        "in the same run; FLOPs are the masked step's, as it runs")
    p.add_argument("--mixer-blocks", type=int, default=2, help="model.masking.mixer_blocks for --mask-ratio")
    p.add_argument("--masked-batch-size", type=int, nargs="+",
                   help="per-GPU batch of the masked step per resolution (default: --batch-size). A masked step "
                        "frees most activation memory, and at the unmasked batch an H100 waits on the host: "
                        "time it at the batch it would train at")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, help="data-sheet dense bf16 peak per GPU, the MFU everyone publishes "
                   "(default: the table for this GPU: A100 312, H100 989, H200 989)")
    p.add_argument("--measure-peak", type=int, metavar="N", default=None,
                   help="also measure the peak with an N^3 bf16 matmul in this run, for a second MFU column "
                        "(default on a GPU: 8192; 0: none)")
    args = p.parse_args(argv)

    args.resolutions = args.resolutions or ([64, 128] if args.tiny else [256, 512])
    args.variants = args.variants or (["eager", "channels_last"] if args.tiny else
                                      ["eager", "channels_last", "compile", "channels_last+compile"])
    device = torch.device(args.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.fsdp or world > 1:
        import torch.distributed as dist
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
    kit = args.kit or _default_kit("tiny" if args.tiny else "sd2-base")
    configs = {"unet": load_unet_config(kit)}
    if "mmdit" in args.denoisers:
        configs["mmdit"] = mmdit_config(args.tiny)
    batches = args.batch_size or ([2] * len(args.resolutions) if args.tiny else
                                  [64 if r <= 256 else 16 for r in args.resolutions])
    # MFU two ways, both in every table: against the data sheet's dense peak (what MosaicML's anchors,
    # Composer's SpeedMonitor and papers report) and against the peak a large matmul reaches here
    spec = args.peak_tflops or (spec_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)
    size = args.measure_peak if args.measure_peak is not None else (8192 if device.type == "cuda" else 0)
    measured = measure_peak_tflops(device, size) if size else None
    rank0 = int(os.environ.get("RANK", "0")) == 0
    encoder = frozen_text_encoder(kit, device) if "ids" in args.text else None
    rows, best = [], {}
    for name in args.denoisers:
        config = configs[name]
        masks = [0.0] + ([args.mask_ratio] if args.mask_ratio and name == "mmdit" else [])
        masked_batches = dict(zip(args.resolutions, args.masked_batch_size or batches))
        for (resolution, batch_size), mask_ratio in itertools.product(zip(args.resolutions, batches), masks):
            batch_size = masked_batches[resolution] if mask_ratio else batch_size
            counted = count_gflop_per_image(config, resolution, mask_ratio, args.mixer_blocks)  # meta: instant
            gflop = SD2_GFLOP_PER_IMAGE.get(resolution, counted) if name == "unet" and not args.tiny else counted
            if rank0 and gflop != counted:
                print(f"FLOP check {resolution}px: counted {counted:.1f} GFLOP/image, DESIGN.md {gflop:.0f}")
            for variant in args.variants:
                for text in args.text:
                    rate = bench_one(config, resolution, batch_size, device, channels_last="channels_last" in variant,
                                     compile_="compile" in variant, fsdp=args.fsdp, steps=args.steps,
                                     warmup=args.warmup, text_encoder=encoder if text == "ids" else None,
                                     mask_ratio=mask_ratio, mixer_blocks=args.mixer_blocks)
                    mfu = rate * gflop * 1e9 / (spec * 1e12) if spec else None
                    mfu_measured = rate * gflop * 1e9 / (measured * 1e12) if measured else None
                    if text == "embeds" and name == "unet":
                        best[resolution] = max(best.get(resolution, 0.0), mfu or 0.0)
                    label = (f"{name} " if len(args.denoisers) > 1 else "") + variant
                    label += (" +fsdp" if args.fsdp else "") + (" text=ids" if text == "ids" else "")
                    label += f" masked {mask_ratio:g}" if mask_ratio else ""
                    rows.append((resolution, label, batch_size, rate, gflop, mfu, mfu_measured))
    if rank0:
        print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} x{world}, kit: {kit}")
        print(f"MFU (spec): against the data-sheet dense bf16 peak, {f'{spec:.1f} TFLOP/s' if spec else 'n/a'}"
              f"{' (--peak-tflops)' if args.peak_tflops else ''}; MFU (meas.): against the peak measured in this run, "
              f"{f'{measured:.1f} TFLOP/s ({size}^3 matmul)' if measured else 'n/a'}")
        print(f"{'res':>5} {'variant':<28} {'batch':>5} {'img/s/GPU':>10} {'GFLOP/img':>10} {'MFU(spec)':>10} "
              f"{'MFU(meas.)':>10} {'vs baseline':>15}")
        rates = {(res, name): rate for res, name, _, rate, *_ in rows}
        for res, variant, bs, rate, gflop, mfu, mfu_measured in rows:
            ratio = ""  # ids: step time over the embeds step's; masked: img/s over the unmasked step's
            if variant.endswith("text=ids") and (res, variant.replace(" text=ids", "")) in rates:
                ratio = f"{rates[(res, variant.replace(' text=ids', ''))] / rate:.2f}x time"
            elif " masked " in variant and (res, variant.split(" masked ")[0]) in rates:
                ratio = f"{rate / rates[(res, variant.split(' masked ')[0])]:.2f}x img/s"
            print(f"{res:>5} {variant:<28} {bs:>5} {rate:>10.2f} {gflop:>10.1f} "
                  f"{f'{mfu:.1%}' if mfu is not None else 'n/a':>10} "
                  f"{f'{mfu_measured:.1%}' if mfu_measured is not None else 'n/a':>10} {ratio:>15}")
        for res in best:
            anchor = ANCHOR_MFU.get(res)
            if not spec:
                print(f"headline {res}px: no MFU (no data-sheet peak for this device: pass --peak-tflops)")
            else:
                print(f"headline {res}px: best MFU (spec) {best[res]:.1%}" +
                      (f" vs MosaicML {anchor:.0%} (spec, A100) ({best[res] / anchor:.2f}x)" if anchor
                       else " (no anchor at this size)"))
    return rows


def mmdit_config(tiny: bool) -> dict:
    """SD3-medium's MMDiT at its published shapes (77 + 256 text tokens; pooled from the text states, so
    4096 wide), or the tiny-mmdit kit's transformer."""
    import json
    if tiny:
        with open(os.path.join(_default_kit("tiny-mmdit"), "transformer", "config.json")) as f:
            return json.load(f)
    from diffusion.kit.build import SD3_MEDIUM, SD3_TEXT_TOKENS
    return dict(SD3_MEDIUM, pooled_projection_dim=SD3_MEDIUM["joint_attention_dim"],
                _class_name="SD3Transformer2DModel", _text_tokens=SD3_TEXT_TOKENS)


def _default_kit(preset: str) -> str:
    from diffusion.kit.build import ensure_kit
    cache = pathlib.Path(os.environ.get("DIFFUSION_TEST_CACHE", pathlib.Path(__file__).resolve().parents[1] / ".cache"))
    return str(ensure_kit(preset, cache / "kit" / preset, progress=False))


if __name__ == "__main__":
    main()
