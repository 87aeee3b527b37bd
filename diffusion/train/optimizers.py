"""The optimizer ``optimizer:`` names, with its parameter groups.

- ``name: adamw`` (the default): torch's AdamW. ``decay: all`` (the default) decays every trainable
  tensor, as every existing YAML trained; ``decay: weights`` decays weight matrices and kernels only,
  not norms, biases or embeddings (common DiT and LLM practice: decay pulls a norm's gain or a bias
  toward 0, which is not a simpler model).
- ``name: muon``: timm's ``Muon`` (momentum orthogonalised by Newton–Schulz) on the hidden matrices,
  the weights of the ``nn.Linear`` and convolution layers inside the denoiser's repeated blocks (the ones
  FSDP wraps; a convolution's (out, in, k…) kernel is flattened to (out, in·k…) for Newton–Schulz, as
  KellerJordan's Muon does: SANA's feed-forward is 1×1 and depthwise convolutions), and its AdamW
  fallback on everything else: embeddings, norms, biases, the input projections (``pos_embed``,
  ``context_embedder``, ``conv_in``) and the final projection (``norm_out``, ``proj_out``). One learning
  rate serves both: timm scales each Muon update to AdamW's RMS (``adjust_lr_fn: match_rms_adamw``,
  Kimi's rule), so ``optimizer.lr`` means what it means for AdamW. Its defaults are KellerJordan's
  Muon's (``Muon`` with its AdamW fallback): Nesterov momentum on the Muon update and plain AdamW
  for the fallback (``nesterov: null``), the coefficients (3.4445, -4.7750, 2.0315) at every
  Newton–Schulz step (``ns_coefficients: original``), Newton–Schulz's own ε (``ns_eps``: 1e-7) apart
  from AdamW's (``eps``), and the fallback's betas (0.9, 0.95) (``betas: null``). What this repository
  trained before is kept behind the keys: ``nesterov: false``, ``ns_coefficients: quintic`` (timm's
  default), ``ns_eps`` equal to ``eps``, ``betas: [0.9, 0.999]``.

Muon needs whole matrices: it is refused in one line at start under FSDP (any sharding but FSDP1's
NO_SHARD). FSDP1 flattens and shards the parameters into 1-D pieces, where there is no matrix to
orthogonalise. Under FSDP2 the parameters are DTensors, which timm's Newton–Schulz multiplies without an
error, but two ranks did not train what one process trains (tiny MMDiT, 3 batches: Muon weights up to
0.03 apart, more than they moved); gathering each matrix for the step is not done here. With DDP every
rank holds whole matrices, and two ranks train what one process trains (tests/train/test_optimizers.py).

The groups are listed at start, one line each: the optimizer, the tensors and parameters it holds.
"""

from __future__ import annotations

import torch

MUON_GROUP = "muon (hidden matrices)"
FALLBACK_GROUP = "adamw"
NO_DECAY_GROUP = "adamw, no decay (norms, biases, embeddings)"


def _owners(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, bool]]:
    """Each trainable parameter's name → (the module holding it directly, whether it sits in a block)."""
    blocks = getattr(getattr(model, "denoiser", model), "fsdp_wrap_fn", None)
    out: dict[str, tuple[torch.nn.Module, bool]] = {}

    def visit(module: torch.nn.Module, prefix: str, in_block: bool) -> None:
        in_block = in_block or bool(blocks is not None and blocks(module))
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                out[prefix + name] = (module, in_block)
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.", in_block)

    visit(model, "", False)
    return out


def decays(name: str, param: torch.Tensor, owner: torch.nn.Module) -> bool:
    """Whether ``decay: weights`` decays this tensor: not a bias, a norm's gain or shift, an embedding
    (a module path with ``embed`` in it: timestep, text and patch embedders, ``nn.Embedding``) or a 1-D tensor."""
    if param.ndim < 2 or name.endswith("bias"):
        return False
    if isinstance(owner, torch.nn.Embedding) or "embed" in name:
        return False
    return "Norm" not in type(owner).__name__


def is_hidden_matrix(name: str, param: torch.Tensor, owner: torch.nn.Module, in_block: bool) -> bool:
    """Muon's tensors: the weights of the ``nn.Linear`` layers (2-D) and of the convolutions (flattened to
    (out, in·k…) by timm's ``conv_mode: flatten``) inside one of the denoiser's repeated blocks."""
    if not (in_block and name.endswith("weight")):
        return False
    if isinstance(owner, torch.nn.Linear):
        return param.ndim == 2
    return isinstance(owner, torch.nn.modules.conv._ConvNd) and param.ndim >= 3


def parameter_groups(model: torch.nn.Module, o) -> list[dict]:
    """The optimizer's groups for ``o`` (the ``optimizer:`` section); each has a ``name`` and ``params``."""
    owners = _owners(model)
    params = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    groups: dict[str, dict] = {}

    def put(group: str, name: str, p, **options) -> None:
        groups.setdefault(group, {"name": group, "params": [], "names": [], **options})
        groups[group]["params"].append(p)
        groups[group]["names"].append(name)

    split_decay = o.decay == "weights"
    for name, p in params.items():
        owner, in_block = owners[name]
        if o.name == "muon" and is_hidden_matrix(name, p, owner, in_block):
            # Newton–Schulz's ε and Nesterov (null: on, KellerJordan's) on this group alone
            put(MUON_GROUP, name, p, use_muon=True, weight_decay=o.weight_decay, eps=o.ns_eps,
                nesterov=True if o.nesterov is None else o.nesterov)
            continue
        # the fallback: AdamW's ε; Nesterov (NAdamW in timm) only when asked for (null: plain AdamW)
        extra = {"use_fallback": True, "eps": o.eps, "nesterov": bool(o.nesterov)} if o.name == "muon" else {}
        if split_decay and not decays(name, p, owner):
            put(NO_DECAY_GROUP, name, p, weight_decay=0.0, **extra)
        else:
            put(f"{FALLBACK_GROUP}{', decay' if split_decay else ''}", name, p, weight_decay=o.weight_decay, **extra)
    order = [MUON_GROUP, FALLBACK_GROUP, f"{FALLBACK_GROUP}, decay", NO_DECAY_GROUP]
    return sorted(groups.values(), key=lambda g: order.index(g["name"]))


def describe_groups(groups: list[dict]) -> list[str]:
    """One line per group: its name, how many tensors and parameters, a few of their names."""
    lines = []
    for g in groups:
        count = sum(p.numel() for p in g["params"])
        shown = ", ".join(g["names"][:3]) + (", ..." if len(g["names"]) > 3 else "")
        lines.append(f"optimizer group {g['name']}: {len(g['params'])} tensors, {count:,} parameters "
                     f"(weight decay {g['weight_decay']}; {shown})")
    return lines


def build_optimizer(cfg, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer of ``cfg.optimizer`` over ``model``'s trainable parameters (see the module docstring).
    ``name: adamw`` with ``decay: all`` is the single AdamW group every existing YAML trained with."""
    o = cfg.optimizer
    fused = torch.cuda.is_available() if o.fused is None else o.fused
    if o.name == "adamw" and o.decay == "all":
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                 fused=fused)
    groups = parameter_groups(model, o)
    from composer.utils import dist
    if dist.get_global_rank() == 0:
        for line in describe_groups(groups):
            print(line, flush=True)
    for g in groups:
        del g["names"]  # not optimizer state: names stay out of checkpoints
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                 fused=fused)
    from timm.optim import Muon
    return Muon(groups, lr=o.lr, weight_decay=o.weight_decay, momentum=o.momentum, nesterov=bool(o.nesterov),
                betas=tuple(o.betas), eps=o.eps, ns_coefficients=o.ns_coefficients, conv_mode="flatten",
                adjust_lr_fn="match_rms_adamw")
