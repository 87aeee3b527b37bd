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


@pytest.mark.parametrize("unbiased", [True, False])
def test_cmmd_matches_a_double_loop(unbiased):
    rng = np.random.default_rng(0)
    x, y = _unit(rng, 9, 6), _unit(rng, 13, 6, shift=0.7)
    assert cmmd.cmmd(x, y, unbiased=unbiased) == pytest.approx(_loop_mmd(x.tolist(), y.tolist(), unbiased), rel=1e-9)
    # unnormalised, larger distances: the kernel's scale shows
    x, y = rng.normal(size=(7, 5)) * 4, rng.normal(size=(8, 5)) * 4 + 2
    assert cmmd.cmmd(x, y, unbiased=unbiased) == pytest.approx(_loop_mmd(x.tolist(), y.tolist(), unbiased), rel=1e-9)


def test_cmmd_is_unbiased_near_zero_for_one_distribution_and_grows_with_the_gap():
    rng = np.random.default_rng(1)
    same = [cmmd.cmmd(_unit(rng, 40, 8), _unit(rng, 40, 8)) for _ in range(30)]
    apart = cmmd.cmmd(_unit(rng, 40, 8), _unit(rng, 40, 8, shift=1.0))
    assert abs(np.mean(same)) < 3 * np.std(same) / np.sqrt(len(same))  # centred on 0, unlike the biased one
    assert np.mean([cmmd.cmmd(_unit(rng, 40, 8), _unit(rng, 40, 8), unbiased=False) for _ in range(10)]) > 0
    assert apart > 10 * np.std(same)
    with pytest.raises(ValueError, match="at least 2 images"):
        cmmd.cmmd(_unit(rng, 1, 8), _unit(rng, 4, 8))


def test_evaluate_reports_cmmd_and_its_protocol(tiny_clip, sample_data, tmp_path):
    evaluate.main(["--images", sample_data, "--reference", sample_data, "--clip-model", tiny_clip,
                   "--device", "cpu", "--out", str(tmp_path / "m.json")])
    metrics = json.loads((tmp_path / "m.json").read_text())
    # a set against itself: 0 up to the unbiased estimator's O(1/n) (the cross term keeps its diagonal)
    assert abs(metrics["cmmd"]) < 0.1
    protocol = metrics["protocol"]
    assert protocol["feature_model"] == tiny_clip and protocol["image_count"] == metrics["num_images"]
    assert protocol["cmmd"]["sigma"] == 10 and protocol["cmmd"]["scale"] == 1000
    assert "shortest side" in protocol["resize"] and protocol["reference_count"] == metrics["num_reference"]
