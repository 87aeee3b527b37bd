"""The optimizer's groups (optimizer.decay, optimizer.name=muon): which tensors decay and which Muon
moves, listed at start; Muon trains, resumes exactly after a kill, refuses FSDP1's flattened shards in
one line (FSDP1's flat shards; FSDP2's DTensors did not train what one process trains); two DDP ranks
training what one process trains is a variant of tests/train/test_fsdp_mmdit.py's launch."""

import os
import re
import shutil

import pytest
import torch

from diffusion.errors import ConfigError
from diffusion.train import optimizers
from diffusion.train.config import load_config
from train_fixtures import fit_in_process, muon_overrides, write_latent_mds

YAML = "yamls/tiny-mmdit-flow-cpu.yaml"


def _denoiser(kit):
    from diffusion.models import denoisers
    adapter = denoisers.adapter("SD3Transformer2DModel")
    return adapter.build(adapter.load_config(kit))


def _groups(kit, *overrides):
    cfg = load_config(YAML, [f"model.ref={kit}", *overrides])
    return {g["name"]: g["names"] for g in optimizers.parameter_groups(_denoiser(kit), cfg.optimizer)}


def test_existing_yamls_keep_one_adamw_group_decaying_everything(mmdit_train_kit):
    cfg = load_config(YAML, [f"model.ref={mmdit_train_kit}"])
    model = _denoiser(mmdit_train_kit)
    optimizer = optimizers.build_optimizer(cfg, model)
    assert type(optimizer) is torch.optim.AdamW and len(optimizer.param_groups) == 1
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_decay_weights_leaves_norms_biases_and_embeddings_undecayed(mmdit_train_kit, capsys):
    groups = _groups(mmdit_train_kit, "optimizer.decay=weights")
    decayed, kept = groups["adamw, decay"], groups["adamw, no decay (norms, biases, embeddings)"]
    assert all(n.endswith("weight") and "embed" not in n for n in decayed)
    assert "transformer_blocks.0.attn.to_q.weight" in decayed and "proj_out.weight" in decayed
    assert {n for n in kept if n.endswith("bias")} == {n for n in decayed + kept if n.endswith("bias")}
    assert {"pos_embed.proj.weight", "context_embedder.weight",
            "time_text_embed.timestep_embedder.linear_1.weight"} <= set(kept)
    model = _denoiser(mmdit_train_kit)
    norms = [f"{m}.{p}" for m, mod in model.named_modules() if "Norm" in type(mod).__name__
             for p, _ in mod.named_parameters(recurse=False)]
    assert set(norms) <= set(kept)  # e.g. the qk-norm gains, when the kit has them
    optimizer = optimizers.build_optimizer(load_config(YAML, [f"model.ref={mmdit_train_kit}",
                                                              "optimizer.decay=weights"]), model)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"optimizer group adamw, no decay (norms, biases, embeddings): "
                                                   f"{len(kept)} tensors, ")


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(mmdit_train_kit, capsys):
    from timm.optim import Muon
    groups = _groups(mmdit_train_kit, "optimizer.name=muon")
    muon, rest = groups[optimizers.MUON_GROUP], groups["adamw"]
    assert muon and all(n.startswith("transformer_blocks.") and n.endswith("weight") for n in muon)
    assert "transformer_blocks.0.attn.to_q.weight" in muon and "transformer_blocks.0.norm1.linear.weight" in muon
    for name in ("proj_out.weight", "norm_out.linear.weight", "pos_embed.proj.weight", "context_embedder.weight",
                 "transformer_blocks.0.attn.to_q.bias"):
        assert name in rest, name
    model = _denoiser(mmdit_train_kit)
    optimizer = optimizers.build_optimizer(load_config(YAML, [f"model.ref={mmdit_train_kit}", "optimizer.name=muon"]),
                                           model)
    assert isinstance(optimizer, Muon) and [g.get("use_muon") for g in optimizer.param_groups] == [True, None]
    assert optimizer.param_groups[1]["use_fallback"]
    lines = capsys.readouterr().out.splitlines()
    count = sum(p.numel() for p in optimizer.param_groups[0]["params"])
    assert lines[0].startswith(f"optimizer group {optimizers.MUON_GROUP}: {len(muon)} tensors, {count:,} parameters")


def _keller_jordan_update(grad: torch.Tensor, momentum: float = 0.95) -> torch.Tensor:
    """KellerJordan's Muon's first update for ``grad``, written out here: Nesterov momentum, the kernel
    flattened to (out, in·k…), five Newton–Schulz steps with (3.4445, -4.7750, 2.0315) after dividing by
    the norm + 1e-7 (in fp32 here; the reference and timm run them in bf16, 2-4% apart from fp32); times
    0.2·√max(A, B) (the RMS-matching scale this repository uses)."""
    buf = (1 - momentum) * grad
    g = grad.lerp(buf, momentum).reshape(len(grad), -1)
    x = g / (g.norm() + 1e-7)
    tall = x.size(0) > x.size(1)
    x = x.mT if tall else x
    for _ in range(5):
        a = x @ x.mT
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    x = (x.mT if tall else x).float()
    return (0.2 * max(g.shape) ** 0.5 * x).reshape(grad.shape)


def test_muon_takes_sanas_convolutions_with_the_references_defaults(tiny_sana_kit):
    """Issue 47, item 8: SANA's feed-forward convolutions are hidden matrices (flattened, as KellerJordan's
    Muon does); the defaults are the reference's: Nesterov, its Newton–Schulz coefficients and ε, and the
    fallback's plain AdamW with betas (0.9, 0.95) and its own ε; timm's quintic and the rest behind keys."""
    from diffusion.kit.build import SANA_1600M
    from diffusion.models import denoisers
    adapter = denoisers.adapter("SanaTransformer2DModel")
    model = adapter.build(adapter.load_config(tiny_sana_kit))
    cfg = load_config(YAML, [f"model.ref={tiny_sana_kit}", "optimizer.name=muon", "optimizer.weight_decay=0",
                             "optimizer.lr=0.01"])
    groups = {g["name"]: g["names"] for g in optimizers.parameter_groups(model, cfg.optimizer)}
    muon = groups[optimizers.MUON_GROUP]
    for conv in ("ff.conv_inverted.weight", "ff.conv_depth.weight", "ff.conv_point.weight"):
        assert f"transformer_blocks.0.{conv}" in muon, conv
    params = dict(model.named_parameters())
    on_muon = sum(params[n].numel() for n in muon)
    # tiny SANA: 34,624 of 56,928 under Muon (16,384 with the Linear weights only); the rest: embedders, proj_out
    assert (on_muon, sum(p.numel() for p in params.values())) == (34_624, 56_928)
    with torch.device("meta"):  # SANA-1.6B as published: 1,557M of 1,604M under Muon (was 803M)
        full = denoisers.adapter("SanaTransformer2DModel").build(SANA_1600M)
    full_groups = optimizers.parameter_groups(full, cfg.optimizer)
    assert [sum(p.numel() for p in g["params"]) for g in full_groups] == [1_557_472_000, 46_990_752]

    optimizer = optimizers.build_optimizer(cfg, model)
    muon_group, fallback = optimizer.param_groups
    assert (muon_group["nesterov"], muon_group["eps"], muon_group["ns_coefficients"]) == (True, 1e-7, "original")
    assert (fallback["nesterov"], fallback["eps"], tuple(fallback["betas"])) == (False, 1e-8, (0.9, 0.95))
    torch.manual_seed(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    optimizer.step()
    for name in ("transformer_blocks.0.ff.conv_inverted.weight", "transformer_blocks.0.attn1.to_q.weight"):
        moved, reference = before[name] - params[name].detach(), 0.01 * _keller_jordan_update(grads[name])
        # within bf16's noise of the reference (timm's quintic coefficients: 20% away; no Nesterov: further)
        assert (moved - reference).norm() / reference.norm() < 0.05, name
    quintic = load_config(YAML, [f"model.ref={tiny_sana_kit}", "optimizer.name=muon", "optimizer.nesterov=false",
                                 "optimizer.ns_coefficients=quintic", "optimizer.betas=[0.9, 0.999]"])
    groups = optimizers.build_optimizer(quintic, model).param_groups
    assert (groups[0]["nesterov"], groups[0]["ns_coefficients"], tuple(groups[1]["betas"])) == (
        False, "quintic", (0.9, 0.999))
    assert load_config(YAML).optimizer.betas == [0.9, 0.999]  # AdamW's own defaults stay


@pytest.mark.parametrize("fsdp", ["{sharding_strategy: SHARD_GRAD_OP}", "{version: 2, sharding_strategy: FULL_SHARD}"])
def test_muon_under_sharded_fsdp_is_refused_in_one_line(fsdp):
    with pytest.raises(ConfigError, match=r"^optimizer.name=muon needs whole weight matrices.*DDP \(trainer.fsdp=null\)"):
        load_config(YAML, ["optimizer.name=muon", f"trainer.fsdp={fsdp}"])
    load_config(YAML, ["optimizer.name=muon", "trainer.fsdp={sharding_strategy: NO_SHARD}"])


@pytest.mark.parametrize("name, override", [("adamw", "optimizer.nesterov=true"), ("adamw", "optimizer.momentum=0.9"),
                                            ("adamw", "optimizer.ns_coefficients=quintic"),
                                            ("adamw", "optimizer.ns_eps=1e-5"), ("muon", "optimizer.fused=true")])
def test_a_key_the_other_optimizer_reads_is_refused_naming_it(name, override):
    """Issue 47, item 7 for the optimizer: Muon's keys under AdamW (and AdamW's fused under Muon) were accepted
    and ignored."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=.* is read only by optimizer.name=\w+, and this run "
                                          rf"trains {name}, which would ignore it"):
        load_config(YAML, [f"optimizer.name={name}", override])
    load_config(YAML, [f"optimizer.name={'muon' if name == 'adamw' else 'adamw'}", override])  # read there


@pytest.fixture(scope="module")
def mds(mmdit_train_kit, tmp_path_factory):
    return write_latent_mds(str(tmp_path_factory.mktemp("mds")), kit=mmdit_train_kit, n=32)


_overrides = muon_overrides


def test_muon_trains_and_a_killed_run_resumes_exactly(mmdit_train_kit, mds, tmp_path):
    straight = tmp_path / "straight"
    before = fit_in_process(load_config(YAML, _overrides(mmdit_train_kit, mds, batches=1)))[0]
    weights, order = fit_in_process(load_config(YAML, _overrides(
        mmdit_train_kit, mds, "trainer.save_interval=2ba", save_folder=str(straight))))
    name = "denoiser.transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(weights[name], before[name])
    ckpt = torch.load(straight / "ep0-ba2-rank0.pt", weights_only=False)
    state = ckpt["state"]["optimizers"]
    (saved,) = state.values()
    assert any("momentum_buffer" in s for s in saved["state"].values())  # Muon's state is checkpointed
    resumed = tmp_path / "resumed"  # "killed" after 2 batches: only the first checkpoint, then autoresume
    resumed.mkdir()
    shutil.copy(straight / "ep0-ba2-rank0.pt", resumed / "ep0-ba2-rank0.pt")
    os.symlink("ep0-ba2-rank0.pt", resumed / "latest-rank0.pt")
    again, order2 = fit_in_process(load_config(YAML, _overrides(
        mmdit_train_kit, mds, "trainer.save_interval=2ba", "trainer.autoresume=true", save_folder=str(resumed))))
    assert order2 == order[2:]
    for key, tensor in weights.items():
        torch.testing.assert_close(again[key], tensor, rtol=0, atol=0, msg=key)


# Two DDP ranks train with Muon what one process trains: test_two_ranks_train_with_muon_as_one_process in
# tests/train/test_fsdp_mmdit.py, a variant of that file's one `composer -n 2` launch.
