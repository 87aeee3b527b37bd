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
    (["--sigma-rel", "0.1", "--out", "{tmp}"], "--out {tmp} is a folder: name the checkpoint file to write, e.g. "
                                               "{tmp}/ema-0.1.pt"),
    (["--sigma-rel", "0.1", "--out", "{run}/latest-rank0.pt/sub/x.pt"],  # was a bare "File exists"
     "--out {run}/latest-rank0.pt/sub/x.pt: cannot make its folder, {run}/latest-rank0.pt is a file"),
    # the run's own snapshot was written over (rc 0) and lost for good
    (["--sigma-rel", "0.1", "--out", "{run}/posthoc/ema-0.050-ba3.safetensors"],
     "--out {run}/posthoc/ema-0.050-ba3.safetensors is one of the run's own checkpoints or snapshots: write the "
     "average to a new file"),
])
def test_bad_input_is_one_line(run, tmp_path, capsys, args, message):
    from diffusion.posthoc_ema import main
    args = [a.format(tmp=tmp_path, run=run) for a in args]
    kept = {name: os.path.getmtime(os.path.join(run, "posthoc", name)) for name in os.listdir(os.path.join(run, "posthoc"))}
    with pytest.raises(SystemExit) as exit:
        cli.run(main, "posthoc_ema", ["--run", run, "--out", str(tmp_path / "x.pt"), *args])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip() == f"posthoc_ema: error: {message.format(tmp=tmp_path, run=run)}"
    assert os.listdir(tmp_path) == []  # nothing written, not even a partial file
    assert {name: os.path.getmtime(os.path.join(run, "posthoc", name))
            for name in os.listdir(os.path.join(run, "posthoc"))} == kept


def test_a_run_without_snapshots_is_one_line(tmp_path, capsys):
    from diffusion.posthoc_ema import main
    with pytest.raises(SystemExit):
        cli.run(main, "posthoc_ema", ["--run", str(tmp_path), "--sigma-rel", "0.1", "--out", str(tmp_path / "x.pt")])
    assert capsys.readouterr().err.strip() == (f"posthoc_ema: error: {tmp_path}: no post-hoc EMA snapshots "
                                               f"(posthoc/ema-*.safetensors): train with algorithms.posthoc_ema "
                                               f"to write them")


def _refusal(capsys, *args):
    from diffusion.posthoc_ema import main
    with pytest.raises(SystemExit) as exit:
        cli.run(main, "posthoc_ema", list(args))
    assert exit.value.code != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def _copy_snapshots(run, tmp_path):
    import shutil
    folder = tmp_path / "copy"
    shutil.copytree(os.path.join(run, "posthoc"), folder / "posthoc")
    os.symlink(os.path.realpath(os.path.join(run, "latest-rank0.pt")), folder / "latest-rank0.pt")
    return folder


@pytest.mark.parametrize("damage", ["cut", "huge"])
def test_a_snapshot_with_a_cut_or_huge_header_is_one_line(run, tmp_path, capsys, damage):
    folder = _copy_snapshots(run, tmp_path)
    path = folder / "posthoc" / "ema-0.100-ba6.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:40] if damage == "cut" else (2 ** 40).to_bytes(8, "little") + data[8:])
    err = _refusal(capsys, "--run", str(folder), "--sigma-rel", "0.1", "--out", str(tmp_path / "x.pt"))
    assert err.startswith(f"posthoc_ema: error: {path}: not a readable safetensors snapshot (")
    assert not (tmp_path / "x.pt").exists()


def test_snapshots_or_a_checkpoint_of_another_run_are_refused_in_one_line(run, tmp_path, capsys):
    """The own-run check of autoresume, for post-hoc EMA: the snapshots carry the run's identity."""
    import json
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    out = str(tmp_path / "x.pt")
    folder = _copy_snapshots(run, tmp_path)
    path = folder / "posthoc" / "ema-0.050-ba3.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    identity = json.loads(meta["run"])
    assert identity["description"]["denoiser"] == "SD3Transformer2DModel" and identity["run"]["data"]
    tensors = load_file(str(path))
    # another run's snapshot among them: the same names and shapes, another training set
    other = dict(identity, run=dict(identity["run"], data="/elsewhere/mds"))
    save_file(tensors, str(path), metadata=dict(meta, run=json.dumps(other)))
    err = _refusal(capsys, "--run", str(folder), "--sigma-rel", "0.1", "--out", out)
    assert err == (f"posthoc_ema: error: {path}: a snapshot of another run than ema-0.100-ba6.safetensors (its "
                   f"training data is '/elsewhere/mds', that one's {identity['run']['data']!r}): give --run the "
                   f"save folder of one run")
    # snapshots written before the identity was recorded: the same names, other shapes
    name = next(n for n, t in tensors.items() if t.dim() == 2)
    bigger = dict(tensors, **{name: torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])})
    save_file(bigger, str(path), metadata={k: v for k, v in meta.items() if k != "run"})
    err = _refusal(capsys, "--run", str(folder), "--sigma-rel", "0.1", "--out", out)
    assert err.startswith(f"posthoc_ema: error: {folder / 'posthoc' / 'ema-0.100-ba3.safetensors'}: holds other "
                          f"parameters than ema-0.050-ba3.safetensors (its {name} is ")
    # a checkpoint of another model: another description (and here, other shapes)
    save_file(tensors, str(path), metadata=meta)
    state = torch.load(os.path.join(run, "latest-rank0.pt"), weights_only=False)
    extra = state["state"]["model"]["_extra_state"]
    extra["description"]["resolution"] = 2 * extra["description"]["resolution"]
    torch.save(state, tmp_path / "other.pt")
    err = _refusal(capsys, "--run", str(folder), "--sigma-rel", "0.1", "--out", out, "--checkpoint",
                   str(tmp_path / "other.pt"))
    assert err.startswith(f"posthoc_ema: error: {tmp_path / 'other.pt'}: a checkpoint of another run than the "
                          f"snapshots (its model.resolution is ")
    del state["state"]["model"]["_extra_state"]  # no description to compare: the shapes still are
    state["state"]["model"][name] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "other.pt")
    err = _refusal(capsys, "--run", str(folder), "--sigma-rel", "0.1", "--out", out, "--checkpoint",
                   str(tmp_path / "other.pt"))
    assert err.startswith(f"posthoc_ema: error: {tmp_path / 'other.pt'}: its {name} is [3, 3], the snapshots' ")
    assert not os.path.exists(out)


def test_a_run_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "weights.pt").write_bytes(b"x")  # was "no such save folder" for a file that is there
    err = _refusal(capsys, "--run", str(tmp_path / "weights.pt"), "--sigma-rel", "0.1", "--out", str(tmp_path / "x.pt"))
    assert err == f"posthoc_ema: error: --run {tmp_path / 'weights.pt'} is a file: give the run's trainer.save_folder"


def test_a_full_disk_while_writing_is_one_line_and_leaves_nothing(run, tmp_path, capsys):
    """The average lands on a device that is always full (its partial file is /dev/full): one line naming the
    file, no traceback (was torch's 'PytorchStreamWriter failed writing file' RuntimeError), nothing left."""
    out = tmp_path / "ema.pt"
    os.symlink("/dev/full", tmp_path / ".partial-ema.pt")
    err = _refusal(capsys, "--run", run, "--sigma-rel", "0.1", "--out", str(out))
    assert err == (f"posthoc_ema: error: {out}: No space left on device: the average was not written (its unfinished "
                   f"file is removed); free space and re-run")
    assert os.listdir(tmp_path) == []
