"""diffusion.kit.scenes: the held-out rule, the prompt sets, and the sample generator's new options."""

import hashlib
import json
import pathlib

import numpy as np

from diffusion.kit import scenes
from diffusion.kit.sample import COLORS, SHAPES, write_sample_data
from diffusion.sample import evaluate


def _digest(directory: pathlib.Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.glob("*.parquet")):
        h.update(p.read_bytes())
    return h.hexdigest()


def test_default_sample_data_is_byte_identical_to_before_the_scene_options(tmp_path):
    # The digest of write_sample_data(n=24, seed=3, rows_per_shard=10) before --scenes/--hold-out existed.
    write_sample_data(tmp_path, n=24, seed=3, rows_per_shard=10)
    assert _digest(tmp_path) == "ac838cf027b6b3b478b3be61aa9ef2e2adf018ba47bbc8487bc346d7514dd6a8"


def test_the_held_out_rule_leaves_every_colour_and_shape_in_training():
    assert len(scenes.HELD_OUT) == 8
    for color in COLORS:
        assert sum(not scenes.held_out(color, s) for s in SHAPES) == 2
    for shape in SHAPES:
        assert sum(not scenes.held_out(c, shape) for c in COLORS) >= 5
    from diffusion.demo import PROMPTS  # the demo's prompts stay trainable
    for prompt in PROMPTS:
        color, shape = prompt.split()[-2:]
        assert not scenes.held_out(color, shape)


def test_prompt_set_has_six_categories_of_held_out_prompts(tmp_path):
    lines = scenes.prompt_set(per_category=12, seed=0)
    assert lines == scenes.prompt_set(per_category=12, seed=0)
    assert [line["tag"] for line in lines] == [t for t in scenes.CATEGORIES for _ in range(12)]
    for line in lines:
        assert any(scenes.held_out(c, s) for c, s in scenes._objects(line)), line
    assert len({line["prompt"] for line in lines if line["tag"] == "position"}) == 12
    counting = [line for line in lines if line["tag"] == "counting"]
    assert all(line["exclude"][0]["count"] == line["include"][0]["count"] + 1 for line in counting)
    scenes.main(["--out", str(tmp_path / "p.jsonl"), "--per-category", "3"])
    written = [json.loads(t) for t in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(written) == 18 and {"tag", "prompt", "include"} <= set(written[0])


def test_geneval_scenes_with_hold_out_draw_all_forms_and_no_held_out_pair(tmp_path):
    write_sample_data(tmp_path, n=80, seed=1, scenes="geneval", hold_out=True)
    captions = [p for _, p in evaluate.iter_images(str(tmp_path)) if p]
    tags = {line["tag"] for c in captions for line in scenes.caption_entries(c)}
    assert tags == set(scenes.CATEGORIES)
    for caption in captions:
        assert not any(scenes.held_out(c, s) for c, s in scenes._objects({"prompt": caption})), caption
    assert json.loads((tmp_path / "manifest.json").read_text())["hold_out"] is True


def test_default_scenes_with_hold_out_draw_no_held_out_pair(tmp_path):
    rng = np.random.default_rng(0)
    from diffusion.kit.sample import draw_row
    for _ in range(60):
        _, caption = draw_row(rng, 64, 64, hold_out=True)
        assert not any(scenes.held_out(c, s) for c, s in scenes._objects({"prompt": caption})), caption


def test_scenes_imports_without_the_sample_generator_and_sample_keeps_its_names():
    # scenes and sample used to import each other; both now draw with diffusion.kit.shapes.
    import subprocess
    import sys

    code = ("import sys, diffusion.kit.scenes; assert 'diffusion.kit.sample' not in sys.modules, 'scenes loads sample'; "
            "from diffusion.kit.sample import BACKGROUNDS, COLORS, RELATIONS, SHAPES, canvas, render_scene")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
