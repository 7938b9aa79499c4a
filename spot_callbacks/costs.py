"""The cost model behind `interval="auto"`: Young's and Daly's optimal checkpoint intervals."""

from __future__ import annotations

import math


def young_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young (1974): tau = sqrt(2 * delta * M).

    Example:
        >>> round(young_interval_s(10, 36000))
        849
    """
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum: sqrt(2dM)*[1 + 1/3 sqrt(d/2M) + 1/9 (d/2M)] - d for d < 2M, else M.

    Example:
        >>> round(daly_interval_s(10, 36000))
        842
    """
    delta, m = checkpoint_cost_s, mtbf_s
    if delta >= 2.0 * m:
        return m
    ratio = delta / (2.0 * m)
    return math.sqrt(2.0 * delta * m) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta
