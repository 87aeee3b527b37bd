"""The end-to-end demo: sample data → kit → Ray conversion → Composer training → a prompt grid."""

import json
import os

import numpy as np
import pytest

from diffusion.kit.sample import render_scene
from diffusion.demo import PROMPTS, run_demo
from diffusion.sample.evaluate import prompt_adherence
from diffusion.sample.grid import read_grid

PROMPT_COLORS = {p.split()[1] for p in PROMPTS}


def _single_shape_scenes(n_wanted: int):
    images, prompts = [], []
    for seed in range(1000):
        image, caption = render_scene(np.random.default_rng(seed), 64, 64)
        words = caption.split()
        single = len(words) == 3 or words[-1] == "background"  # "a red circle [on a gray background]"
        if words[1] in PROMPT_COLORS and single:
            images.append(image)
            prompts.append(" ".join(words[:3]))
        if len(images) == n_wanted:
            return images, prompts
    raise AssertionError("not enough single-shape scenes")


def test_adherence_is_perfect_on_real_scenes_and_near_chance_when_prompts_are_shuffled():
    images, prompts = _single_shape_scenes(60)
    assert prompt_adherence(images, prompts) == 1.0
    shuffled = prompts[7:] + prompts[:7]
    assert prompt_adherence(images, shuffled) < 0.4


# The demo is reproducible: the same rows make the same MDS parts (--deterministic, parts named by their
# keys) and trainer.seed fixes the model's init, so this test sees the same score on every run here.
# `make demo BATCHES=1250`: the default recipe, shortened as README's Quickstart offers it. The MMDiT's grid is
# already in its prompts' colours by then: 48% at 1,250 batches (30% at 1,000, 59% at 1,500, 58% at the recipe's
# 2,000: BENCHMARKS.md, "The demo's recipe" and "The suite's wall time, session 26"); the test's floor is 33%.
# Three-eighths fewer batches than the recipe in the suite's longest file.
TEST_BATCHES = 1250


def test_make_demo_trains_the_flow_mmdit_for_2000_batches_by_default():
    from diffusion.demo import DEFAULT_RECIPE, RECIPES
    assert DEFAULT_RECIPE == "mmdit-flow" and RECIPES[DEFAULT_RECIPE][1:] == ("tiny-mmdit", "checkpoints-mmdit-flow", 2000)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # `make demo` itself (1,250 batches), twice over, then the UNet on buckets: 6-11 min beside a worker
def test_demo_runs_end_to_end_and_the_model_follows_its_prompts(tiny_mmdit_kit, tiny_kit, tmp_path):
    out = tmp_path / "demo"
    summary = run_demo(str(out), n=1024, batches=TEST_BATCHES, kit=tiny_mmdit_kit)
    # `make demo` trains its default recipe, the flow MMDiT, for the batches asked
    assert summary["recipe"] == "mmdit-flow" and f"-ba{TEST_BATCHES}-" in os.path.basename(summary["checkpoint"])
    manifest = json.loads((out / "raw" / "manifest.json").read_text())
    # every row is written or rejected once, by reason: the metadata filter's rules, duplicates, bad rows
    assert summary["samples"] + sum(summary["rejects"].values()) == manifest["rows"]
    assert summary["rejects"]["filtered: aesthetic >= 3.5"] > 0
    assert summary["rejects"]["duplicate_image"] > 0  # the sample's bad rows share bytes (1x1 images, HTML)
    assert 0.8 * manifest["good"] < summary["samples"] < manifest["good"]
    for picture in (summary["grid"], summary["before_after"]):
        assert os.path.getsize(picture) > 1000
    assert json.loads((out / "summary.json").read_text())["prompt_adherence"] == summary["prompt_adherence"]
    # Learned conditioning: the colour the prompt names dominates well above chance (1 in 6).
    assert summary["prompt_adherence"] >= 2 / len(PROMPTS), summary["prompt_adherence"]
    # The scene judge's categories for the colour prompts: the shape named, and in its colour.
    assert set(summary["judge"]) == {"single_object", "colors"}
    assert summary["judge"]["colors"] <= summary["judge"]["single_object"]
    assert set(summary["judge_floor"]) == set(summary["judge"])  # what colour noise scores, printed beside it
    # `make demo` a second time in the same folder: every step finds its output done (the run's last
    # checkpoint is there, the grid drawn from it is kept as it was: run.py's own report of a finished run
    # is tests/train/test_trainer.py's)
    drawn = os.path.getmtime(summary["grid"])
    again = run_demo(str(out), n=1024, batches=TEST_BATCHES, kit=tiny_mmdit_kit)
    assert again["checkpoint"] == summary["checkpoint"] and os.path.getmtime(again["grid"]) == drawn
    assert again["prompt_adherence"] == summary["prompt_adherence"]
    assert [step["command"].split()[1:3] for step in again["steps"]] == [["-m", "diffusion.kit.build"]]  # the kit check
    # `python -m diffusion.demo --recipe unet --buckets` after it in the same --out, on the same sample rows: the
    # rows are converted again, into the preset buckets beside the square conversion (before, the square one was
    # found done and the run trained and drew on square crops), and the UNet trains on them into its own
    # checkpoint folder and draws its grids, square and at the buckets' two other shapes; the flow MMDiT's
    # conversion, checkpoint and grid are left as they were
    before = {path: os.path.getmtime(path) for path in (summary["checkpoint"], summary["grid"],
                                                        out / "mds" / "dataset.json")}
    unet = run_demo(str(out), n=1024, batches=20, kit=tiny_kit, recipe="unet", buckets=True, images_per_prompt=4)
    assert unet["recipe"] == "unet" and unet["checkpoint"] == str(out / "checkpoints-buckets" / "ep0-ba20-rank0.pt")
    assert unet["mds"] == str(out / "mds-buckets") and unet["grid"] == str(out / "grid-buckets.png")
    assert before == {path: os.path.getmtime(path) for path in before}
    # the sample's scenes of every shape land in the three preset buckets, each a dataset of its own
    counts = {b["name"]: b["count"] for b in unet["buckets"]}
    assert sorted(counts) == ["bucket-48x80", "bucket-64x64", "bucket-80x48"] and min(counts.values()) > 100, counts
    assert sum(counts.values()) == unet["samples"]
    for name, (width, height) in (("48x80", (48, 80)), ("80x48", (80, 48)), ("square", (64, 64))):
        images, prompts = read_grid(unet["grids"][name])
        assert len(images) == len(PROMPTS) * 4 and images[0].size == (width, height), name
        assert 0.0 <= unet["prompt_adherence_by_grid"][name] <= 1.0


def test_each_recipe_and_conversion_has_its_own_folders_under_one_out():
    """`make demo`, `make demo RECIPE=unet`, `--buckets` and `--curate` in one --out: none reads another's
    conversion, checkpoints or grid (the bucketed run is trained end to end above)."""
    from diffusion.demo import demo_paths
    names = {(recipe, buckets, curate): tuple(os.path.relpath(p, "o") for p in demo_paths("o", recipe, buckets, curate))
             for recipe in ("mmdit-flow", "unet") for buckets in (False, True) for curate in (False, True)}
    assert names[("mmdit-flow", False, False)] == ("raw", "mds", "checkpoints-mmdit-flow", "grid-mmdit-flow.png")
    assert names[("unet", False, False)] == ("raw", "mds", "checkpoints", "grid.png")
    assert names[("unet", True, False)] == ("raw", "mds-buckets", "checkpoints-buckets", "grid-buckets.png")
    assert names[("mmdit-flow", True, True)][1:] == ("mds-buckets-curated", "checkpoints-mmdit-flow-buckets-curated",
                                                     "grid-mmdit-flow-buckets-curated.png")
    for part in (1, 2, 3):  # conversions, checkpoint folders, grids: each variant its own
        kinds = {(k[1], k[2]) if part == 1 else k: v[part] for k, v in names.items()}
        assert len(set(kinds.values())) == len(kinds), part


def test_a_rerun_keeps_a_grid_drawn_by_the_same_command_from_the_same_checkpoint(tmp_path):
    """The demo's grid step is skipped, as its other steps are, only when the grid was drawn by the same
    command from a checkpoint no newer than it: a longer run (a newer checkpoint) or other settings redraw."""
    import sys
    import time
    from diffusion.demo import _draw
    checkpoint, grid = tmp_path / "latest-rank0.pt", tmp_path / "grid.png"
    checkpoint.write_bytes(b"weights")
    draw = [sys.executable, "-c", f"import time; open({str(grid)!r}, 'a').write(str(time.time()))"]
    log = []
    _draw(draw, str(grid), str(checkpoint), log)
    _draw(draw, str(grid), str(checkpoint), log)
    assert len(log) == 1 and len(grid.read_text()) > 0
    _draw(draw + ["--other"], str(grid), str(checkpoint), log)  # other settings
    assert len(log) == 2
    time.sleep(0.01)
    checkpoint.write_bytes(b"trained further")
    _draw(draw + ["--other"], str(grid), str(checkpoint), log)  # a newer checkpoint
    assert len(log) == 3
    _draw(draw + ["--other"], str(grid), str(checkpoint), log)
    assert len(log) == 3
