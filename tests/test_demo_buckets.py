"""The demo with ``--buckets`` (its own file, so ``make test``'s workers run it beside the end-to-end demo)."""

import pytest

from diffusion.demo import PROMPTS, run_demo
from diffusion.sample.grid import read_grid


@pytest.mark.slow
def test_the_demo_converts_into_buckets_trains_on_them_and_draws_each_aspect_ratio(tiny_kit, tmp_path):
    """`python -m diffusion.demo --buckets`: the sample's scenes of every shape land in the three preset
    buckets, the model trains on them and draws the prompts at 48x80 and 80x48 as well as square."""
    summary = run_demo(str(tmp_path / "demo"), n=256, batches=20, kit=tiny_kit, buckets=True, recipe="unet",
                       images_per_prompt=4)
    counts = {b["name"]: b["count"] for b in summary["buckets"]}
    assert sorted(counts) == ["bucket-48x80", "bucket-64x64", "bucket-80x48"] and all(c > 30 for c in counts.values()), counts
    assert sum(counts.values()) == summary["samples"]
    for name, (width, height) in (("48x80", (48, 80)), ("80x48", (80, 48)), ("square", (64, 64))):
        images, prompts = read_grid(summary["grids"][name])
        assert len(images) == len(PROMPTS) * 4 and images[0].size == (width, height), name
        assert 0.0 <= summary["prompt_adherence_by_grid"][name] <= 1.0
