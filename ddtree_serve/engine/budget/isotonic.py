"""Weighted least-squares non-decreasing fit (pool adjacent violators), for rates and costs."""

import numpy as np


def isotonic_increasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in weighted squared error: same shape."""
    values = np.asarray(values, float)
    if np.all(values[1:] >= values[:-1]):
        return values.copy()  # already in order: the common case, without the Python loop
    blocks: list[list[float]] = []  # [mean, weight, length] of each pooled run
    for value, weight in zip(values.tolist(), np.asarray(weights, float).tolist(), strict=True):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight_b, length = blocks.pop()
            previous = blocks[-1]
            total = previous[1] + weight_b
            previous[0] = (previous[0] * previous[1] + mean * weight_b) / total
            previous[1] = total
            previous[2] += length
    return np.concatenate([np.full(int(length), mean) for mean, _, length in blocks])
