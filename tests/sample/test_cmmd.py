"""diffusion.sample.cmmd against an independent double loop, and evaluate's CMMD and protocol."""

import json
import math

import numpy as np
import pytest

from diffusion.sample import cmmd, evaluate


def _loop_mmd(x, y, unbiased=True):
    """The paper's estimator written out term by term: sigma 10, x1000."""
    def k(a, b):
        return math.exp(-sum((p - q) ** 2 for p, q in zip(a, b)) / (2 * 10.0 ** 2))
    n, m = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i in range(n) for j in range(n) if i != j or not unbiased)
    yy = sum(k(y[i], y[j]) for i in range(m) for j in range(m) if i != j or not unbiased)
    xy = sum(k(x[i], y[j]) for i in range(n) for j in range(m))
    if unbiased:
        return 1000 * (xx / (n * (n - 1)) + yy / (m * (m - 1)) - 2 * xy / (n * m))
    return 1000 * (xx / n ** 2 + yy / m ** 2 - 2 * xy / (n * m))


def _unit(rng, n, d, shift=0.0):
    v = rng.normal(size=(n, d)) + shift
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.mark.parametrize("estimator", ["unbiased", "biased"])
def test_cmmd_matches_a_double_loop(estimator):
    unbiased = estimator == "unbiased"
    rng = np.random.default_rng(0)
    x, y = _unit(rng, 9, 6), _unit(rng, 13, 6, shift=0.7)
    assert cmmd.cmmd(x, y, estimator) == pytest.approx(_loop_mmd(x.tolist(), y.tolist(), unbiased), rel=1e-9)
    # unnormalised, larger distances: the kernel's scale shows
    x, y = rng.normal(size=(7, 5)) * 4, rng.normal(size=(8, 5)) * 4 + 2
    assert cmmd.cmmd(x, y, estimator) == pytest.approx(_loop_mmd(x.tolist(), y.tolist(), unbiased), rel=1e-9)


def test_the_default_is_the_reference_codes_estimator_on_fixed_sets():
    """google-research/cmmd's distance.mmd: k = exp(-|x - y|^2 / (2 * 10^2)), x1000, the mean over ALL pairs of
    each set (diagonal included) plus the other set's, less twice the cross mean. Numbers computed once by that
    formula in its matrix form."""
    x = [[1, 0, 0], [0, 1, 0], [0.6, 0.8, 0]]
    y = [[0, 0, 1], [0.8, 0, 0.6]]
    assert cmmd.cmmd(x, y) == pytest.approx(10.123456087736571, rel=1e-12)
    x2, y2 = np.arange(12).reshape(4, 3) / 10.0, -np.arange(9).reshape(3, 3) / 7.0
    assert cmmd.cmmd(x2, y2) == pytest.approx(38.13773074456339, rel=1e-12)
    assert cmmd.cmmd(x, y, "unbiased") == pytest.approx(6.356319844231573, rel=1e-12)  # the named other one
    assert cmmd.protocol()["estimator"].startswith("biased (google-research/cmmd")
    with pytest.raises(ValueError, match="estimator 'v': biased"):
        cmmd.cmmd(x, y, "v")
    from diffusion.train.callbacks.judge_metrics import JudgeMetrics
    with pytest.raises(ValueError, match=r"callbacks.judge_metrics.cmmd_estimator='v': biased"):
        JudgeMetrics(cmmd_estimator="v")


def test_cmmd_biased_sits_above_zero_for_one_distribution_unbiased_is_centred_and_both_grow_with_the_gap():
    rng = np.random.default_rng(1)
    same = [cmmd.cmmd(_unit(rng, 40, 8), _unit(rng, 40, 8), "unbiased") for _ in range(30)]
    apart = cmmd.cmmd(_unit(rng, 40, 8), _unit(rng, 40, 8, shift=1.0), "unbiased")
    assert abs(np.mean(same)) < 3 * np.std(same) / np.sqrt(len(same))  # centred on 0, unlike the biased one
    # the callback's sizes, 48 against 256 of one distribution: the reference's estimator is ~0.1 above 0
    biased = np.mean([cmmd.cmmd(_unit(rng, 48, 8), _unit(rng, 256, 8)) for _ in range(10)])
    assert biased > 0.05 and biased > 5 * abs(np.mean(same))
    assert apart > 10 * np.std(same) and cmmd.cmmd(_unit(rng, 40, 8), _unit(rng, 40, 8, shift=1.0)) > biased
    with pytest.raises(ValueError, match="at least 2 images"):
        cmmd.cmmd(_unit(rng, 1, 8), _unit(rng, 4, 8))


def test_evaluate_reports_cmmd_and_its_protocol(tiny_clip, sample_data, tmp_path):
    evaluate.main(["--images", sample_data, "--reference", sample_data, "--clip-model", tiny_clip,
                   "--device", "cpu", "--out", str(tmp_path / "m.json")])
    metrics = json.loads((tmp_path / "m.json").read_text())
    # a set against itself: 0 with the reference's (biased) estimator, the default
    assert abs(metrics["cmmd"]) < 1e-9 and metrics["protocol"]["cmmd"]["estimator"].startswith("biased")
    protocol = metrics["protocol"]
    assert protocol["feature_model"] == tiny_clip and protocol["image_count"] == metrics["num_images"]
    assert protocol["cmmd"]["sigma"] == 10 and protocol["cmmd"]["scale"] == 1000
    assert "shortest side" in protocol["resize"] and protocol["reference_count"] == metrics["num_reference"]
