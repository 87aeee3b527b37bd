"""Flux's and SANA's transformers under real FSDP on CPU (`composer -n 2`, gloo): each block (Flux's double- and
single-stream ones, SANA's) is its own FSDP unit (FSDP1 and FSDP2), and two ranks with EMA and microbatches
train, with rectified flow on 16-channel and DC-AE latents, the weights and EMA one process trains on the
same global batches."""

import json

import pytest
import torch

from diffusion.models import loading
from diffusion.train.config import load_config
from train_fixtures import (FSDP_VARIANTS_HARNESS, fit_in_process, launch_composer, tiny_overrides,
                            write_latent_mds)

YAML = "yamls/tiny-mmdit-flow-cpu.yaml"


KITS = {"tiny_flux_kit": (["FluxTransformerBlock", "FluxSingleTransformerBlock"], 3),
        "tiny_sana_kit": (["SanaTransformerBlock"], 2)}


@pytest.mark.slow
def test_two_ranks_fsdp_train_the_transformers_as_one_process_with_ema(request, tmp_path):
    """Both transformers, FSDP1 and FSDP2, in one `composer -n 2` launch (a launch is mostly start-up)."""
    commons, variants = {}, []
    for kit_name, (blocks, _) in sorted(KITS.items()):
        kit = request.getfixturevalue(kit_name)
        space = loading.latent_space_of(loading.load_vae_config(kit))
        mds = write_latent_mds(str(tmp_path / f"mds-{kit_name}"), kit=kit, n=32, latent_space=space)
        commons[kit_name] = tiny_overrides(kit, mds, batches=3, batch_size=8, extra=(
            "model.prediction_type=null", "model.objective=flow", "data.train.shuffle=false",
            "optimizer.eps=1.0", "optimizer.lr=0.05", "trainer.grad_clip_norm=null",
            "algorithms.ema.smoothing=0.9", "algorithms.ema.warmup=false",
            "trainer.device_train_microbatch_size=2"))
        for version in (1, 2):
            fsdp = ("trainer.fsdp={sharding_strategy: FULL_SHARD}" if version == 1
                    else "trainer.fsdp={version: 2, sharding_strategy: FULL_SHARD}")
            variants.append({"name": f"{kit_name}-fsdp{version}", "blocks": blocks,
                             "overrides": [*commons[kit_name], fsdp]})
    result = launch_composer(tmp_path / "harness.py", FSDP_VARIANTS_HARNESS, [YAML],
                             env={"RECORD_DIR": str(tmp_path), "VARIANTS": json.dumps(variants)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    for kit_name, (_, count) in sorted(KITS.items()):
        one = fit_in_process(load_config(YAML, commons[kit_name]))[0]
        for name in (f"{kit_name}-fsdp1", f"{kit_name}-fsdp2"):
            ranks = [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in range(2)]
            assert ranks[0]["blocks"] == count, (name, ranks[0]["blocks"])  # every block its own unit
            final = ranks[0]["final"]
            assert len(final) > 20 and set(final) <= set(one)
            for key, tensor in final.items():
                torch.testing.assert_close(tensor, one[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
            ema = ranks[0]["ema"]
            assert set(ema) == set(final)
            assert [k for k in ema if not torch.allclose(ema[k], one[k])]  # the EMA is its own average
