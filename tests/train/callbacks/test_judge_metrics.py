"""callbacks.judge_metrics: the scene judge's categories logged during training, its cost counted, and
training's random draws unchanged by it."""

import os

import torch

from diffusion.kit.scenes import CATEGORIES
from diffusion.train.config import load_config
from train_fixtures import fit_in_process, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")


def test_judge_metrics_are_logged_and_leave_training_unchanged(tiny_kit, tmp_path):
    from diffusion.train.callbacks.judge_metrics import JudgeMetrics
    mds = write_latent_mds(str(tmp_path / "mds"), kit=tiny_kit, n=16)
    cfg = load_config(TINY, tiny_overrides(tiny_kit, mds, batches=4, batch_size=8, extra=(
        "data.train.num_workers=0", "data.train.shuffle=true", "model.offset_noise=0.1")))

    judged = JudgeMetrics(per_category=1, images_per_prompt=1, steps=2, interval="2ba")
    with_judge, batches = fit_in_process(cfg, callbacks=[judged])
    without, batches_without = fit_in_process(cfg)
    assert batches == batches_without
    for name in without:  # the same draws: the same weights after 4 batches
        torch.testing.assert_close(with_judge[name], without[name], rtol=0, atol=0, msg=name)
    assert [h["batch"] for h in judged.history] == [2, 4]
    assert set(judged.lines[i]["tag"] for i in range(len(judged.lines))) == set(CATEGORIES)
    logged = judged.history[-1]  # what went to logger.log_metrics, i.e. to every logger destination
    for tag in CATEGORIES:
        assert 0.0 <= logged[f"metrics/judge/{tag}"] <= 1.0
    assert logged["metrics/judge/seconds"] > 0
    assert logged["metrics/judge/seconds_total"] > logged["metrics/judge/seconds"]  # two rounds counted


def test_judge_metrics_log_cmmd_against_a_reference(tiny_kit, tiny_clip, sample_data, tmp_path):
    from diffusion.train.callbacks.judge_metrics import JudgeMetrics
    mds = write_latent_mds(str(tmp_path / "mds"), kit=tiny_kit, n=16)
    cfg = load_config(TINY, tiny_overrides(tiny_kit, mds, batches=2, batch_size=8, extra=("data.train.num_workers=0",)))
    judged = JudgeMetrics(per_category=1, images_per_prompt=1, steps=2, interval="2ba", clip_model=tiny_clip,
                          reference=sample_data, reference_images=16)
    fit_in_process(cfg, callbacks=[judged])
    (logged,) = judged.history
    assert logged["metrics/judge/cmmd"] > 0  # untrained samples against drawn scenes
    assert len(judged._reference_features) == 16
