"""The paper's statistical model of underflow (Zhao et al., IJCAI 2020, §3-4.2), in log2 space.

Pure functions on host floats; everything here is exact arithmetic on a handful of statistics,
so it runs only on scale-update iterations. Scales are powers of two and handled as their
integer exponents: multiplying by ``2.0 ** k`` is exact in every binary float format.
"""

from __future__ import annotations

import math
from statistics import NormalDist

_STANDARD_NORMAL = NormalDist()
_SQRT2 = math.sqrt(2.0)


def erfinv(y: float) -> float:
    """Inverse error function on (-1, 1)."""
    return _STANDARD_NORMAL.inv_cdf((y + 1.0) / 2.0) / _SQRT2


def gemm_sigma(accumulation_length: float, grad_rms: float, operand_rms: float) -> float:
    """Lemma 1: σ of a GEMM output ∇X = fG(∇Y, W) whose elements are sums of N products."""
    return math.sqrt(accumulation_length) * grad_rms * operand_rms


def gemm_underflow_rate(log2_scale: float, sigma: float, lambda_min: float) -> float:
    """Theorem 1: γ(α) = erf(λmin / (√2 α σ)), the expected fraction of elements lost to underflow."""
    if sigma <= 0.0:
        return 0.0
    return math.erf(lambda_min / (_SQRT2 * sigma * 2.0**log2_scale))


def gemm_min_log2_scale(sigma: float, lambda_min: float, target: float) -> float:
    """Theorem 1 solved for α: the real log2 of the smallest scale with γ(α) ≤ target.

    Returns ``-inf`` when the output is all zeros (no scale can help, none is needed) or already
    non-finite (the step will be skipped whatever the scale).
    """
    if not 0.0 < sigma < math.inf:
        return -math.inf
    return math.log2(lambda_min / (_SQRT2 * sigma * erfinv(target)))


def cast_underflow_rate(log2_scale: float, log_mean: float, log_std: float, lambda_min: float) -> float:
    """Theorem 2: γ(α) = ½(1 + erf((ln λmin − μ − ln α) / (√2 σ))) for log-normal gradients."""
    z = math.log(lambda_min) - log_mean - log2_scale * math.log(2.0)
    if log_std <= 0.0:
        return 1.0 if z >= 0.0 else 0.0
    return 0.5 * (1.0 + math.erf(z / (_SQRT2 * log_std)))


def cast_min_log2_scale(log_mean: float, log_std: float, lambda_min: float, target: float) -> float:
    """Theorem 2 solved for α: ln α ≥ ln λmin − μ − √2 σ erfinv(2γ' − 1), returned as log2 α."""
    ln_alpha = math.log(lambda_min) - log_mean - _SQRT2 * log_std * erfinv(2.0 * target - 1.0)
    return ln_alpha / math.log(2.0)


def overflow_max_log2_scale(largest_output: float, lambda_max: float) -> float:
    """Real log2 of the bound on α from α · largest_output < λmax (``inf`` when unconstrained)."""
    if not largest_output > 0.0 or not math.isfinite(largest_output):
        return math.inf
    return math.log2(lambda_max / largest_output)


def choose_log2_scale(lower: float, upper: float, ceiling: int | None = None) -> int:
    """Pick the exponent of a power-of-two scale (paper §4.2).

    The smallest power of two meeting the underflow bound ``lower`` (rounded **up**), but not
    below 2^0; less than 2^0 only when the strict overflow bound ``upper`` allows no scale ≥ 1
    (rounded **down**, so that α < 2^upper holds strictly). ``ceiling`` caps the result.
    """
    exponent = max(math.ceil(lower), 0) if math.isfinite(lower) else 0
    if math.isfinite(upper):
        exponent = min(exponent, math.ceil(upper) - 1)
    if ceiling is not None:
        exponent = min(exponent, ceiling)
    return exponent


def branch_log2_scale(incoming: list[int], largest_true_value: float, lambda_max: float) -> int:
    """Algorithm 1, line 17: the common scale for gradients summed at a branch.

    The largest incoming exponent α_j with 2^α_j · max_i(max|∇X_i| / α_i) < λmax; if none fits,
    the smallest is halved until one does.
    """
    bound = overflow_max_log2_scale(largest_true_value, lambda_max)
    for exponent in sorted(set(incoming), reverse=True):
        if exponent < bound:
            return exponent
    return min(min(incoming), math.ceil(bound) - 1)
