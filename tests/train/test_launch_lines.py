"""What ``python run.py`` says about itself: one line naming the denoiser class, its parameter count and the
objective at start, and on Ctrl-C the README's "interrupted at batch N; re-run the same command ..." (Composer's
engine turns SIGINT into ``sys.exit(130)``, which ``except KeyboardInterrupt`` alone never saw)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from train_fixtures import tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_start_line_names_the_model_and_ctrl_c_says_where_training_stopped(train_kit, tmp_path):
    from diffusers import UNet2DConditionModel

    from diffusion.kit import build as kit
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=32)
    folder = tmp_path / "ckpt"
    args = [os.path.join(ROOT, "yamls", "tiny-cpu.yaml"),
            *tiny_overrides(train_kit, mds, batches=100000, save_folder=str(folder),
                            extra=("trainer.autoresume=true", "trainer.save_interval=1ba", "algorithms={}"))]
    run = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), *args], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not os.path.lexists(folder / "latest-rank0.pt") and run.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert run.poll() is None, run.stderr.read()[-3000:]
        run.send_signal(signal.SIGINT)  # what Ctrl-C sends
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 130, err[-3000:]
    [line] = [x for x in err.splitlines() if "interrupted" in x]
    assert re.fullmatch(r"run\.py: interrupted at batch [1-9]\d*; re-run the same command to resume from its "
                        r"last checkpoint", line), line
    assert "Traceback" not in err, err[-3000:]
    count = sum(p.numel() for p in UNet2DConditionModel(**kit.TINY_UNET).parameters())
    assert f"model: UNet2DConditionModel denoiser, {count:,} parameters; objective epsilon (DDPM, predicting the " \
           f"noise (epsilon))" in out.splitlines(), out[-2000:]


def test_readme_training_commands_do_not_share_a_save_folder():
    """Two README commands that train other models or data into one save folder: the second is refused
    (autoresume continues only its own run). Each README training command's save folder (its YAML's, or
    its trainer.save_folder=) holds one model reference and one dataset; and a command's model.ref is where
    README builds a kit (the MLPerf CPU twin's YAML names .cache/kit/tiny-flux, README builds kits/flux)."""
    import shlex

    import yaml
    text = open(os.path.join(ROOT, "README.md")).read()
    runs = {}
    for line in re.findall(r"^(?:composer|python) (?:-n \d+ )?run\.py (yamls/\S+\.yaml[^\n#`]*)", text, re.M):
        words = shlex.split(line)
        with open(os.path.join(ROOT, words[0])) as f:
            recipe = yaml.safe_load(f)
        given = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        folder = given.get("trainer.save_folder", recipe["trainer"].get("save_folder"))
        what = (given.get("model.ref", recipe["model"].get("ref")),
                given.get("data.train.path", recipe["data"]["train"].get("path")))
        runs.setdefault(folder, set()).add(what)
    assert len(runs) > 5
    shared = {folder: sorted(map(str, whats)) for folder, whats in runs.items() if len(whats) > 1}
    assert not shared, shared
    built = {path.strip("`") for path in re.findall(r"diffusion\.kit --preset \S+ --out (\S+)", text)}
    built.add(".cache/kit/tiny")  # make demo's kit
    refs = {ref for whats in runs.values() for ref, _ in whats if ref and ref.startswith(("kits/", ".cache/kit/"))}
    assert refs - built == set()
