"""Saved activations per sample, counted on the meta device (no memory, no compute): what a training
step's forward keeps for backward, with and without per-block activation checkpointing
(``trainer.activation_checkpointing``), and whether a YAML's microbatch fits a GPU by that count.

The count is in bf16 (model and inputs cast, as ``amp_bf16`` computes the blocks): every tensor autograd
saves (``torch.autograd.graph.saved_tensors_hooks``), each once however many ops save it, parameters and
their views left out. On an H200 the UNet's and the MMDiT's measured bytes came within 5% above it, Flux's
(diffusers 0.42, torch 2.11) 23% below (BENCHMARKS.md, session 33). With checkpointing, each block keeps
only its inputs, and one block's own activations are live again while it is recomputed in backward:
(outside the blocks) + (every block's inputs) + (the largest block's activations).

    python -m diffusion.train.activation_memory yamls/sd2-base-256.yaml [--microbatch N] [--gpus N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

GiB = 2 ** 30


@dataclasses.dataclass
class SavedActivations:
    """Bytes per sample autograd saves in one training forward."""

    outside: int  # saved outside the blocks (embeddings, the UNet's down/upsamplers, the output head)
    blocks: list[int]  # saved inside each block
    block_inputs: list[int]  # each block's tensor inputs (what a checkpointed block keeps)

    @property
    def plain(self) -> int:
        return self.outside + sum(self.blocks)

    @property
    def checkpointed(self) -> int:
        return self.outside + sum(self.block_inputs) + max(self.blocks, default=0)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _FusedAttention(torch.autograd.Function):
    """Scaled dot-product attention as a GPU's fused kernels (flash, memory-efficient) save it for backward:
    the query, key, value, output and one float per query and head, never the attention matrix (which
    the meta device's math fallback would save)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None, None

    @staticmethod
    def call(*args, **kwargs):
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]
        return _FusedAttention.apply(q, k, v)


def forward_inputs(adapter, config: dict, latent_size: int, text_length: int, text_dim: int, batch: int):
    """``(sample, timestep, text, pooled kwargs)`` of one bf16 training forward of ``batch`` samples, on the current
    default device (the meta device's count, and a real forward measured against it)."""
    sample = torch.randn(batch, adapter.latent_channels(config), latent_size, latent_size, dtype=torch.bfloat16)
    text = torch.randn(batch, text_length, text_dim, dtype=torch.bfloat16)
    pooled_dim = adapter.pooled_dim(config) if adapter.pooled_text else None
    pooled = {"pooled": torch.randn(batch, pooled_dim, dtype=torch.bfloat16)} if pooled_dim else {}
    return sample, torch.full((batch,), 500.0), text, pooled


def count_saved(adapter, config: dict, latent_size: int, text_length: int, text_dim: int,
                batch: int = 1) -> SavedActivations:
    """Saved activations of one forward of ``batch`` samples of the denoiser of ``config``, per sample."""
    model_class = adapter.model_class  # imported outside the meta device's context
    with torch.device("meta"):
        module = model_class.from_config(config).to(torch.bfloat16)
        sample, timestep, text, pooled = forward_inputs(adapter, config, latent_size, text_length, text_dim, batch)
    module.train()
    parameters = {id(p) for p in module.parameters()}
    blocks = [m for m in module.modules() if type(m).__name__ in adapter.blocks]
    inside, inputs, current = [0] * len(blocks), [0] * len(blocks), []
    outside = [0]

    def pre(index):
        def hook(_, args, kwargs):
            if not current:
                inputs[index] += sum(_bytes(t) for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))
            current.append(index)
        return hook

    def post(_, args, kwargs, output):
        current.pop()

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))

    seen, keep = set(), []  # a tensor saved by several ops (or views of one) is held once, counted once

    def pack(t: torch.Tensor):
        base = t._base if getattr(t, "_base", None) is not None else t
        if id(base) not in parameters and id(base) not in seen:
            seen.add(id(base))
            keep.append(base)  # ids stay unique while the forward runs
            if current:
                inside[current[0]] += _bytes(base)
            else:
                outside[0] += _bytes(base)
        return None

    sample.requires_grad_(True)
    import torch.nn.functional as F
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _FusedAttention.call  # what a GPU's fused attention keeps, not the matrix
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
            adapter(module, sample, timestep, text, **pooled)
    finally:
        F.scaled_dot_product_attention = sdpa
        for handle in handles:
            handle.remove()
    return SavedActivations(outside=outside[0] // batch, blocks=[b // batch for b in inside],
                            block_inputs=[b // batch for b in inputs])


def text_length_of(ref: str, adapter) -> int:
    """The text sequence the YAML's data carries: 256 T5 tokens for Flux (the MLPerf recipe's
    ``--text-length 256``), CLIP's 77 otherwise."""
    from diffusion import schema
    return 256 if adapter.class_name == "FluxTransformer2DModel" else schema.MAX_TOKENS


def yaml_report(path: str, ref: str | None = None, gpus: int | None = None) -> dict:
    """The YAML's microbatch, its saved activations per sample with and without checkpointing (GiB), and
    the GiB of weights, gradients and AdamW state each GPU holds under its sharding (fp32 master weights;
    ``gpus`` ranks: the global batch / 32 unless given)."""
    from diffusion.models import denoisers
    from diffusion.train.config import load_config
    cfg = load_config(path, [f"model.ref={ref}"] if ref else [])
    t = cfg.trainer
    class_name = denoisers.resolve_class(cfg.model.ref, cfg.model.denoiser)
    adapter = denoisers.adapter(class_name)
    config = adapter.load_config(cfg.model.ref)
    latent = cfg.model.resolution // 8
    saved = count_saved(adapter, config, latent, text_length_of(cfg.model.ref, adapter), adapter.text_dim(config))
    with torch.device("meta"):
        parameters = sum(p.numel() for p in adapter.model_class.from_config(config).parameters())
    gpus = gpus or max(1, cfg.data.train.batch_size // 32)
    sharded = 1 if t.fsdp is None or t.fsdp.sharding_strategy == "NO_SHARD" else gpus
    # fp32 weights, gradients, two AdamW moments (16 B a parameter); weights whole unless FULL_SHARD, and one
    # bf16 copy gathered for compute
    whole_weights = t.fsdp is None or t.fsdp.sharding_strategy != "FULL_SHARD"
    states = parameters * (12 / sharded + (4 if whole_weights else 4 / sharded) + 2 * (1 if whole_weights else 0))
    per_gpu = cfg.data.train.batch_size // gpus
    micro = t.device_train_microbatch_size if isinstance(t.device_train_microbatch_size, int) else per_gpu
    activations = saved.checkpointed if t.activation_checkpointing else saved.plain
    return {"yaml": path, "denoiser": class_name, "parameters": parameters, "gpus": gpus, "microbatch": micro,
            "activation_checkpointing": t.activation_checkpointing,
            "saved_gib_per_sample": round(saved.plain / GiB, 3),
            "saved_gib_per_sample_checkpointed": round(saved.checkpointed / GiB, 3),
            "states_gib": round(states / GiB, 1), "activations_gib": round(micro * activations / GiB, 1),
            "total_gib": round((states + micro * activations) / GiB, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("yamls", nargs="+")
    parser.add_argument("--ref", help="model reference (a kit) in place of the YAML's model.ref")
    parser.add_argument("--gpus", type=int, help="ranks the run shards over (default: global batch / 32)")
    args = parser.parse_args(argv)
    for path in args.yamls:
        print(json.dumps(yaml_report(path, args.ref, args.gpus)))


if __name__ == "__main__":
    main()
