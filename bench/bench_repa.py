"""What REPA (``model.repa``) costs: the encoder's input decoded in the step (our choice) against stored crops
or stored encoder features, in bytes per sample and training FLOPs per image, at 256 and 512 px.

    python bench/bench_repa.py

Full size (FLOPs counted by torch's FlopCounterMode on the meta device, no memory, no compute): the
micro-budget MMDiT (kit's MMDIT_BASE, ~1.3B, patches of 2 over SD's 4-channel /8 latents) trained at
3 × forward; REPA adds the SD VAE's decode (decode in the step), DINOv2-B/14's forward at 224 px (256) or
448 px (512), and the projector (1152 → 2048 → 2048 → 768, 3 × forward). Bytes: the stored latent column
(posterior moments, float16), the crop as raw uint8 RGB, DINOv2-B's patch features in float16.

Tiny (CPU-seconds per training step, batch 8, this machine): the tiny MMDiT with and without REPA (the
shipped tiny VAE and tiny ViT), and the parts: decode, encoder, projector.
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def full_size_table() -> list[dict]:
    from diffusers import AutoencoderKL
    from transformers import Dinov2Config, Dinov2Model

    from diffusion.kit.build import MMDIT_BASE, SD2_TEXT, SD2_VAE
    from diffusion.models import denoisers
    from diffusion.models.repa import _count, _projector_flops, Projector
    adapter = denoisers.adapter("SD3Transformer2DModel")
    rows = []
    for resolution, encoder_size in ((256, 224), (512, 448)):
        latent = resolution // 8
        step = 3 * adapter.forward_flops(dict(MMDIT_BASE), latent, SD2_TEXT["hidden_size"], 77)
        decode = _count(lambda: AutoencoderKL(**SD2_VAE), (1, 4, latent, latent), lambda m, z: m.decode(z))
        dino = Dinov2Config(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, patch_size=14,
                            image_size=encoder_size)
        encode = _count(lambda: Dinov2Model(dino), (1, 3, encoder_size, encoder_size),
                        lambda m, x: m(pixel_values=x))
        tokens = (latent // 2) ** 2
        width = MMDIT_BASE["num_attention_heads"] * MMDIT_BASE["attention_head_dim"]
        project = 3 * _projector_flops(Projector(width, 2048, 768), tokens)
        patches = (encoder_size // 14) ** 2
        rows.append({"resolution": resolution, "step": step, "decode": decode, "encode": encode, "project": project,
                     "moments_bytes": 8 * latent * latent * 2, "crop_bytes": resolution * resolution * 3,
                     "features_bytes": patches * 768 * 2})
    return rows


def tiny_times(steps: int = 5, batch: int = 8) -> dict:
    """CPU-seconds per training step of the tiny MMDiT without and with REPA, and of REPA's parts."""
    import shutil
    import tempfile

    from diffusion import schema
    from diffusion.kit.build import ensure_kit
    from diffusion.kit.encoder_fit import TINY_ENCODER_ASSET
    from diffusion.models.latent_diffusion import build_model
    from diffusion.train.config import FlowConfig, ModelConfig, RepaConfig
    kit = str(ensure_kit("tiny-mmdit", ROOT / ".cache" / "kit" / "tiny-mmdit", progress=False))
    info = schema.DatasetInfo(model=kit, scaling_factor=0.18215, resolutions=[64], text_dim=32)
    from diffusion.models import loading
    info.text_dim = loading.load_text_encoder_config(kit)["hidden_size"]
    g = torch.Generator().manual_seed(0)
    data = {schema.BATCH_MOMENTS: torch.cat([torch.randn(batch, 4, 8, 8, generator=g),
                                             torch.full((batch, 4, 8, 8), -8.0)], 1),
            schema.BATCH_TEXT_EMBEDS: torch.randn(batch, 77, info.text_dim, generator=g)}

    def per_step(model) -> float:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for i in range(steps + 1):
            if i == 1:
                start = time.process_time()
            loss = model.loss(model(data), data)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return (time.process_time() - start) / steps

    base = ModelConfig(ref=kit, resolution=64, objective="flow", flow=FlowConfig())
    plain = per_step(build_model(base, info))
    base.repa = RepaConfig(encoder=str(TINY_ENCODER_ASSET), block=2, projector_dim=256)
    model = build_model(base, info)
    aligned = per_step(model)
    latents = model.sample_latents(data[schema.BATCH_MOMENTS])

    def timed(fn) -> float:
        fn()
        start = time.process_time()
        for _ in range(steps):
            fn()
        return (time.process_time() - start) / steps
    with torch.no_grad():
        images = model.repa.decoder(latents)
        decode = timed(lambda: model.repa.decoder(latents))
        encode = timed(lambda: model.repa.encoder.features(images))
    return {"plain": plain, "repa": aligned, "decode": decode, "encode": encode}


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'px':>4} {'MMDiT step GFLOP':>17} {'decode':>8} {'DINOv2-B':>9} {'projector':>10} "
          f"{'decode in step':>15} {'stored crop':>12} {'stored features':>16}")
    for r in full_size_table():
        g = lambda x: x / 1e9  # noqa: E731
        overhead = lambda *parts: f"+{sum(parts) / r['step']:.1%}"  # noqa: E731
        print(f"{r['resolution']:>4} {g(r['step']):>17,.0f} {g(r['decode']):>8,.0f} {g(r['encode']):>9,.0f} "
              f"{g(r['project']):>10,.1f} {overhead(r['decode'], r['encode'], r['project']):>15} "
              f"{overhead(r['encode'], r['project']):>12} {overhead(r['project']):>16}")
        print(f"{'':>4} bytes per sample: moments {r['moments_bytes']:,}; + crop {r['crop_bytes']:,} "
              f"({r['crop_bytes'] / r['moments_bytes']:.0f}x); + features {r['features_bytes']:,} "
              f"({r['features_bytes'] / r['moments_bytes']:.0f}x); decode in step + 0")
    t = tiny_times()
    print(f"\ntiny MMDiT, batch 8, CPU-s per step: plain {t['plain']:.3f}, with REPA {t['repa']:.3f} "
          f"(+{t['repa'] / t['plain'] - 1:.0%}); decode {t['decode']:.3f}, encoder {t['encode']:.3f}")


if __name__ == "__main__":
    main()
