"""``python -m diffusion.posthoc_ema``: a trained run's snapshots become a checkpoint that generate and export
take, holding the synthesised average as its EMA; bad input is one line."""

import os

import pytest
import torch

from diffusion import cli
from diffusion.models.checkpoint import load_denoiser
from diffusion.train.config import load_config
from train_fixtures import fit_in_process, tiny_overrides, write_latent_mds


@pytest.fixture(scope="module")
def run(tiny_mmdit_kit, tmp_path_factory):
    """The tiny MMDiT kit trained 6 batches with the EMA and post-hoc profiles 0.05 and 0.10 (snapshots every 3)."""
    root = tmp_path_factory.mktemp("posthoc_run")
    mds = write_latent_mds(str(root / "mds"), kit=tiny_mmdit_kit, n=32)
    folder = str(root / "ckpt")
    fit_in_process(load_config("yamls/tiny-mmdit-flow-cpu.yaml", tiny_overrides(
        tiny_mmdit_kit, mds, batches=6, batch_size=8, save_folder=folder, extra=(
            "model.prediction_type=null", "model.objective=flow", "trainer.save_interval=6ba",
            "algorithms.posthoc_ema={sigma_rels: [0.05, 0.10], snapshot_every: 3ba}"))))
    return folder


def tracked(folder, sigma_rel):
    state = torch.load(os.path.join(folder, "latest-rank0.pt"), weights_only=False)["state"]
    (algorithm,) = [s for name, s in state["algorithms"] if name == "PostHocEMA"]
    (profile,) = [p for p in algorithm["profiles"] if p["sigma_rel"] == sigma_rel]
    return profile["ema_params"]


def test_the_command_writes_a_checkpoint_generate_and_export_take(run, tmp_path, capsys):
    from diffusion.posthoc_ema import main
    from diffusion.sample import export, generate
    out = str(tmp_path / "ema-0.10.pt")
    main(["--run", run, "--sigma-rel", "0.10", "--out", out])
    printed = capsys.readouterr().out
    assert "sigma_rel 0.1 (gamma 6.94) at batch 6 from 4 snapshots" in printed
    assert f"python -m diffusion.generate --checkpoint {out}" in printed
    denoiser, _, ema_used = load_denoiser(out)
    assert ema_used
    weights = {"denoiser." + k: v for k, v in denoiser.state_dict().items()}
    profile = tracked(run, 0.10)  # a tracked width comes back as the run tracked it
    for name, tensor in profile.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    raw, _, _ = load_denoiser(os.path.join(run, "latest-rank0.pt"), ema=False)
    assert not torch.equal(raw.pos_embed.proj.weight, denoiser.pos_embed.proj.weight)

    grid = str(tmp_path / "grid.png")
    generate.main(["--checkpoint", out, "--prompt", "a red circle", "--steps", "2", "--out", grid, "--device", "cpu"])
    assert os.path.getsize(grid) > 0
    exported = str(tmp_path / "exported")
    export.main(["--checkpoint", out, "--out", exported])
    assert os.path.exists(os.path.join(exported, "transformer", "config.json"))

    # an untracked width between the two, at the first snapshot's batch
    between = str(tmp_path / "ema-0.08.pt")
    main(["--run", run, "--sigma-rel", "0.08", "--out", between, "--batch", "3"])
    assert "at batch 3 from 2 snapshots" in capsys.readouterr().out
    assert load_denoiser(between)[2]


@pytest.mark.parametrize("args, message", [
    (["--sigma-rel", "0.4"], "--sigma-rel: sigma_rel 0.4 must be a number in (0, 0.2887): a fraction of the run's "
                             "length, e.g. 0.05 or 0.10 (EDM2's range)"),
    (["--sigma-rel", "0.1", "--batch", "4"], "--batch 4: no snapshot at that batch; the run has snapshots at [3, 6]"),
])
def test_bad_input_is_one_line(run, tmp_path, capsys, args, message):
    from diffusion.posthoc_ema import main
    with pytest.raises(SystemExit) as exit:
        cli.run(main, "posthoc_ema", ["--run", run, "--out", str(tmp_path / "x.pt"), *args])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip() == f"posthoc_ema: error: {message}"


def test_a_run_without_snapshots_is_one_line(tmp_path, capsys):
    from diffusion.posthoc_ema import main
    with pytest.raises(SystemExit):
        cli.run(main, "posthoc_ema", ["--run", str(tmp_path), "--sigma-rel", "0.1", "--out", str(tmp_path / "x.pt")])
    assert capsys.readouterr().err.strip() == (f"posthoc_ema: error: {tmp_path}: no post-hoc EMA snapshots "
                                               f"(posthoc/ema-*.safetensors): train with algorithms.posthoc_ema "
                                               f"to write them")
