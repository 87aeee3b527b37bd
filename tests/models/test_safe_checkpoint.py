"""A checkpoint never runs code when read (issue 24, item 1): a real training checkpoint carrying a pickle
payload is refused in one line by every command that reads checkpoints and by training's load_path and
autoresume, and the payload never runs; real checkpoints still load."""

import os

import pytest
import torch

from diffusion.models import safe_checkpoint
from sampling_helpers import train_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Payload:
    """What an attacker pickles: unpickling it calls os.system, which leaves a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def checkpoints(tiny_kit, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    good = train_tiny_checkpoint(tiny_kit, str(tmp / "run"))
    saved = torch.load(good, map_location="cpu", weights_only=False)  # our own file: the test may trust it
    marker = tmp / "payload-ran"
    saved["state"]["callbacks"] = {"Innocent": {"note": Payload(str(marker))}}
    bad = tmp / "ep0-ba3-rank0.pt"
    torch.save(saved, bad)
    return {"good": good, "bad": str(bad), "marker": marker, "tmp": tmp, "kit": tiny_kit}


ENTRIES = {"generate": "diffusion.sample.generate", "export": "diffusion.sample.export",
           "evaluate": "diffusion.sample.evaluate", "run.py": "diffusion.launch"}


def _run_here(capfd, prog, *args):
    """``prog ARGS`` through its ``cli.run`` entry in this process (cli_helpers.run_entry): a payload that ran would
    touch the marker as in a subprocess, without ~4 s (generate, export, evaluate) or ~15 s (run.py) of imports a
    refusal. Torch's threads stay this process's (OMP_NUM_THREADS set: run.py leaves them)."""
    import importlib
    from cli_helpers import run_entry
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(torch.get_num_threads())}
    return run_entry(capfd, importlib.import_module(ENTRIES[prog]).main, prog, *args, env=env)


def _refused(result, path):
    lines = [line for line in result.stderr.splitlines() if "error:" in line]  # (Composer's own warnings aside)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-2000:]
    assert path in lines[0] and "refused" in lines[0] and "posix.system" in lines[0]


def test_a_real_checkpoint_loads_weights_only(checkpoints):
    state = safe_checkpoint.load(checkpoints["good"])["state"]
    assert "model" in state and state["algorithms"][0][0] == "EMA"
    assert not checkpoints["marker"].exists()


@pytest.mark.parametrize("command", ["generate", "export", "evaluate"])
def test_commands_refuse_a_checkpoint_that_would_run_code(checkpoints, command, tiny_clip, capfd):
    bad, tmp = checkpoints["bad"], checkpoints["tmp"]
    args = {"generate": ["--prompt", "a red circle", "--out", str(tmp / "g.png"), "--steps", "1"],
            "export": ["--out", str(tmp / "exported")],
            "evaluate": ["--prompts-file", str(_prompts(tmp)), "--out", str(tmp / "scores.json"),
                         "--clip-model", tiny_clip]}[command]
    _refused(_run_here(capfd, command, "--checkpoint", bad, *args), bad)
    assert not checkpoints["marker"].exists()


def _prompts(tmp):
    path = tmp / "prompts.txt"
    path.write_text("a red circle\n")
    return path


def test_training_refuses_it_as_load_path_and_in_autoresume(checkpoints, capfd, monkeypatch):
    from train_fixtures import tiny_overrides, write_latent_mds
    bad, tmp, kit = checkpoints["bad"], checkpoints["tmp"], checkpoints["kit"]
    mds = write_latent_mds(str(tmp / "mds"), kit=kit, n=16)
    monkeypatch.chdir(ROOT)
    common = ["run.py", "yamls/tiny-cpu.yaml", *tiny_overrides(kit, mds, batches=4, batch_size=4)]
    _refused(_run_here(capfd, *common, f"trainer.load_path={bad}"), bad)
    folder = tmp / "resume"
    folder.mkdir()
    os.symlink(bad, folder / "latest-rank0.pt")  # a save folder whose latest checkpoint was swapped
    result = _run_here(capfd, *common, f"trainer.save_folder={folder}", "trainer.autoresume=true")
    _refused(result, "latest-rank0.pt")
    assert not checkpoints["marker"].exists()


def test_a_raw_pickle_or_a_legacy_tar_is_one_line_naming_the_file(tmp_path):
    """Neither is a file torch.save writes today; each is refused in one line, not torch's paragraphs."""
    import io
    import pickle
    import tarfile
    from diffusion.errors import InputError
    raw = tmp_path / "weights.pkl"
    raw.write_bytes(pickle.dumps({"weight": [1.0, 2.0]}))
    with pytest.raises(InputError) as refused:
        safe_checkpoint.load(raw)
    assert str(refused.value).startswith(f"{raw}: refused: not a checkpoint torch.save wrote (a raw pickle")
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 400
    legacy = tmp_path / "old.tar"
    with tarfile.open(legacy, "w") as archive:
        data = b"hello"
        info = tarfile.TarInfo("storages")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    with pytest.raises(InputError, match=r"refused: a checkpoint in torch's legacy \.tar format"):
        safe_checkpoint.load(legacy)
