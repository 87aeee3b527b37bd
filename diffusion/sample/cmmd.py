"""CMMD (Jayasumana et al. 2024, "Rethinking FID"): the maximum mean discrepancy between two sets of CLIP
image embeddings under a Gaussian RBF kernel.

    k(x, y) = exp(-|x - y|² / (2 σ²)),  σ = 10
    CMMD = 1000 · MMD²,  MMD² = mean_{i≠j} k(x_i, x_j) + mean_{i≠j} k(y_i, y_j) - 2 mean_{i,j} k(x_i, y_j)

the unbiased estimator the paper writes (its reference code averages over i = j too, the "biased",
minimum-variance estimator; ``unbiased=False`` gives that one; the two differ by O(1/n)). Embeddings are
L2-normalised, as the paper's are (:class:`diffusion.sample.evaluate.ClipScorer` normalises). Unlike
FID it assumes no Gaussian shape and is unbiased at small sample counts.
"""

from __future__ import annotations

import numpy as np

SIGMA = 10.0
SCALE = 1000.0
MIN_IMAGES = 2  # the unbiased within-set means need two samples


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


def cmmd(x: np.ndarray, y: np.ndarray, unbiased: bool = True) -> float:
    """CMMD between embedding sets ``x`` (n × d) and ``y`` (m × d), scaled by 1000."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n, m = len(x), len(y)
    for name, count in (("first", n), ("second", m)):
        if count < MIN_IMAGES:
            raise ValueError(f"CMMD needs at least {MIN_IMAGES} images per set; the {name} set has {count}")
    kxx, kyy, kxy = _kernel_sums(x, x), _kernel_sums(y, y), _kernel_sums(x, y)
    if unbiased:  # the diagonal, k(x, x) = 1, left out
        within = (kxx - n) / (n * (n - 1)) + (kyy - m) / (m * (m - 1))
    else:
        within = kxx / n ** 2 + kyy / m ** 2
    return float(SCALE * (within - 2.0 * kxy / (n * m)))


PROTOCOL = {"kernel": "gaussian rbf", "sigma": SIGMA, "scale": SCALE, "estimator": "unbiased",
            "embeddings": "L2-normalised CLIP image embeddings"}
