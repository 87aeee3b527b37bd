"""CMMD (Jayasumana et al. 2024, "Rethinking FID"): the maximum mean discrepancy between two sets of CLIP
image embeddings under a Gaussian RBF kernel.

    k(x, y) = exp(-|x - y|² / (2 σ²)),  σ = 10
    CMMD = 1000 · MMD²,  MMD² = mean_{i,j} k(x_i, x_j) + mean_{i,j} k(y_i, y_j) - 2 mean_{i,j} k(x_i, y_j)

By default the estimator of the paper's reference code (google-research/cmmd), which every published
CMMD number comes from: the "biased" V-statistic, its within-set means over i = j too. It is above 0 for
two sets of one distribution, by O(1/n) (about 0.1 at 48 against 256 images), so compare numbers at the
same set sizes. ``estimator="unbiased"`` leaves the diagonal out of the within-set means (the U-statistic
the paper writes, centred on 0; not comparable with published numbers). Embeddings are L2-normalised, as
the paper's are (:class:`diffusion.sample.evaluate.ClipScorer` normalises). Unlike FID it assumes no
Gaussian shape.
"""

from __future__ import annotations

import numpy as np

SIGMA = 10.0
SCALE = 1000.0
MIN_IMAGES = 2  # the unbiased within-set means need two samples
ESTIMATORS = ("biased", "unbiased")  # the reference code's (default), the paper's U-statistic


def _kernel_sums(a: np.ndarray, b: np.ndarray, chunk: int = 2048) -> float:
    """Σ_ij k(a_i, b_j), in row chunks so a large set never needs an n × m matrix at once."""
    gamma = 1.0 / (2.0 * SIGMA ** 2)
    b_sq = (b * b).sum(1)
    total = 0.0
    for start in range(0, len(a), chunk):
        rows = a[start:start + chunk]
        sq = (rows * rows).sum(1)[:, None] + b_sq[None, :] - 2.0 * rows @ b.T
        total += float(np.exp(-gamma * np.maximum(sq, 0.0)).sum())
    return total


def cmmd(x: np.ndarray, y: np.ndarray, estimator: str = "biased") -> float:
    """CMMD between embedding sets ``x`` (n × d) and ``y`` (m × d), scaled by 1000; ``estimator``: "biased"
    (the reference code's) or "unbiased"."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"CMMD estimator {estimator!r}: biased (the reference code's) or unbiased")
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n, m = len(x), len(y)
    for name, count in (("first", n), ("second", m)):
        if count < MIN_IMAGES:
            raise ValueError(f"CMMD needs at least {MIN_IMAGES} images per set; the {name} set has {count}")
    kxx, kyy, kxy = _kernel_sums(x, x), _kernel_sums(y, y), _kernel_sums(x, y)
    if estimator == "unbiased":  # the diagonal, k(x, x) = 1, left out
        within = (kxx - n) / (n * (n - 1)) + (kyy - m) / (m * (m - 1))
    else:
        within = kxx / n ** 2 + kyy / m ** 2
    return float(SCALE * (within - 2.0 * kxy / (n * m)))


def protocol(estimator: str = "biased") -> dict:
    """What a CMMD number was computed with, for a metrics file."""
    return {"kernel": "gaussian rbf", "sigma": SIGMA, "scale": SCALE,
            "estimator": estimator + (" (google-research/cmmd's)" if estimator == "biased" else ""),
            "embeddings": "L2-normalised CLIP image embeddings"}
