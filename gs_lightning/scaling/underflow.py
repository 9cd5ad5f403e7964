"""The statistical model of underflow (Zhao et al., IJCAI 2020, §3-4.2), in log2 space.

Pure functions on a handful of statistics (host floats; the branch rule's on the device, unread), exact
arithmetic that runs only on scale-update iterations. Scales are powers of two and handled as their
integer exponents: multiplying by ``2.0 ** k`` is exact in every binary float format.

Where this deviates from the paper, and why (issue #8; Monte Carlo: ``python -m
gs_lightning.analysis.underflow_mc``, γ' = 1e-3, measured underflow at the chosen scale):

- GEMMs with a short accumulation length N: Lemma 1 calls a sum of N products of Gaussians
  Gaussian, but for small N it has far more mass near zero (N = 1 has a log singularity there):
  Theorem 1 leaves 4-8e-3 at N = 1 and 1.2-1.5e-3 at N = 2 for Gaussian ∇Y and W. Given N,
  :func:`gemm_underflow_rate` and :func:`gemm_min_log2_scale` use the exact distribution instead
  (a Gaussian whose variance is a χ²_N-distributed sum of squares): ≤ 1e-3 for every N. It tends
  to Theorem 1 as N grows, which is used as is from :data:`GAUSSIAN_ACCUMULATION_LENGTH` on.
- Casts and probed GEMM outputs, where exact values are at hand: :func:`sample_min_log2_scale`
  reads the scale off an order statistic of the values themselves. Theorem 2's log-normal fit
  leaves 1.3e-2 for a Gaussian gradient, 8.6e-3 for Laplace, 1.2e-2 for a sparse one; no model of
  ∇Y and W at all fits softmax cross-entropy gradients (Theorem 1 leaves up to 0.2 at N ≤ 4). The
  order statistic of a probe slice (:mod:`~gs_lightning.scaling.probes`) stays ≤ 1.3e-3 for all
  of these, every N from 1 to 4096, Linear, Conv2d and bmm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from statistics import NormalDist

import torch
from torch.utils._python_dispatch import _disable_current_modes

_STANDARD_NORMAL = NormalDist()
_SQRT2 = math.sqrt(2.0)


def erfinv(y: float) -> float:
    """Inverse error function on (-1, 1)."""
    return _STANDARD_NORMAL.inv_cdf((y + 1.0) / 2.0) / _SQRT2


def gemm_sigma(accumulation_length: float, grad_rms: float, operand_rms: float) -> float:
    """Lemma 1: σ of a GEMM output ∇X = fG(∇Y, W) whose elements are sums of N products."""
    return math.sqrt(accumulation_length) * grad_rms * operand_rms


# From this accumulation length on, Theorem 1's Gaussian is used as is: the exact distribution's
# γ' quantile is then within 0.02% of the Gaussian's (2^-12 in log2 scale).
GAUSSIAN_ACCUMULATION_LENGTH = 4096.0


def gemm_underflow_rate(
    log2_scale: float, sigma: float, lambda_min: float, accumulation_length: float = math.inf
) -> float:
    """The expected fraction of a scaled GEMM output's elements that fall below ``lambda_min``.

    Theorem 1, γ(α) = erf(λmin / (√2 α σ)), when ``accumulation_length`` is at least
    :data:`GAUSSIAN_ACCUMULATION_LENGTH` (the default: the paper's model). Below that, the exact
    rate for a sum of N products of independent zero-mean Gaussians with σ = √N σ₁σ₂ (see
    :func:`product_sum_cdf`).
    """
    if sigma <= 0.0:
        return 0.0
    threshold = lambda_min / (sigma * 2.0**log2_scale)
    n = _checked_length(accumulation_length)
    if n >= GAUSSIAN_ACCUMULATION_LENGTH:
        return math.erf(threshold / _SQRT2)
    return product_sum_cdf(threshold * math.sqrt(n), n)


def gemm_min_log2_scale(
    sigma: float | torch.Tensor, lambda_min: float, target: float, accumulation_length: float = math.inf
) -> torch.Tensor:
    """:func:`gemm_underflow_rate` solved for α: the real log2 of the smallest scale with γ(α) ≤ target.

    On the device of ``sigma`` (a float: the CPU), unread. ``-inf`` when the output is all zeros (no
    scale can help, none is needed) or already non-finite (the step will be skipped whatever the scale).
    """
    sigma = as_float64(sigma)
    _check_target(target)
    n = _checked_length(accumulation_length)
    if n >= GAUSSIAN_ACCUMULATION_LENGTH:
        smallest = divide(lambda_min, _SQRT2 * sigma * erfinv(target))
    else:  # γ(α) = F_N(λmin √N / (α σ)) ≤ target  ⟺  α ≥ λmin √N / (σ F_N⁻¹(target))
        smallest = divide(lambda_min * math.sqrt(n), sigma * product_sum_quantile(target, n))
    return where_or((sigma > 0.0) & (sigma < math.inf), torch.log2(smallest), -math.inf)


def product_sum_cdf(x: float, accumulation_length: float) -> float:
    """P(|Σᵢ aᵢbᵢ| < x) for N independent pairs of standard normals (N need not be an integer).

    Given b, the sum is N(0, V) with V = Σ bᵢ² ~ χ²_N, so the probability is E[erf(x / √(2V))]:
    a smooth one-dimensional integral over V, done by the trapezoidal rule in ln V (spectrally
    accurate here: the integrand is analytic and decays doubly exponentially on one side and
    exponentially on the other). N = 2 gives a Laplace law, N = 1 the product-normal law with its
    log singularity at zero; for large N it tends to erf(x / √(2N)).
    """
    if x <= 0.0:
        return 0.0
    if math.isinf(x):
        return 1.0
    step, nodes = _product_sum_grid(accumulation_length)
    total = 0.0
    for half_root, density in nodes:
        total += math.erf(x / half_root) * density
    return min(1.0, total * step)


@functools.lru_cache(maxsize=1024)
def _product_sum_grid(accumulation_length: float) -> tuple[float, tuple[tuple[float, float], ...]]:
    """:func:`product_sum_cdf`'s quadrature for one N: the step, and per node (2√U, density of ln U).

    They depend on N only; an update evaluates the rate of every GEMM at its scale, so they are
    computed once per N (the sum over them then costs a few hundred ``erf``, not ``exp`` besides).
    """
    shape = accumulation_length / 2.0  # V = 2U, U ~ Gamma(shape, 1); integrate over y = ln U
    spread = 1.0 / math.sqrt(shape)
    step = min(0.1, 0.25 * spread)
    # The integrand is at most the density of y = ln U, whose left tail falls below 1e-17 there.
    lower = math.log(shape) - 12.0 * spread - 40.0 / shape
    upper = math.log(shape + 12.0 * math.sqrt(shape) + 45.0)
    log_norm = -math.lgamma(shape)
    nodes = []
    for i in range(math.ceil((upper - lower) / step) + 1):
        y = lower + i * step
        u = math.exp(y)
        nodes.append((2.0 * math.sqrt(u), math.exp(shape * y - u + log_norm)))
    return step, tuple(nodes)


@functools.lru_cache(maxsize=1024)
def product_sum_quantile(rate: float, accumulation_length: float) -> float:
    """The x with :func:`product_sum_cdf` (x, N) = rate: the γ' quantile of |Σᵢ aᵢbᵢ| (cached per N, γ')."""
    _check_target(rate)
    # Bisection on ln x: F rises monotonically; the Gaussian quantile (an upper bound for small
    # rates) and a bracket widened by e^{±2} per try start it.
    gaussian = _SQRT2 * math.sqrt(accumulation_length) * erfinv(rate)
    low, high = math.log(gaussian) - 2.0, math.log(gaussian) + 2.0
    while product_sum_cdf(math.exp(low), accumulation_length) > rate:
        low -= 2.0
    while product_sum_cdf(math.exp(high), accumulation_length) < rate:
        high += 2.0
    for _ in range(60):
        middle = 0.5 * (low + high)
        if product_sum_cdf(math.exp(middle), accumulation_length) < rate:
            low = middle
        else:
            high = middle
        if high - low < 1e-9:
            break
    return math.exp(low)  # the lower end: F(x) ≤ rate, so scales from it meet the target


def _check_target(target: float) -> None:
    if not 0.0 < target < 1.0:
        raise ValueError(f"underflow target must lie in (0, 1), got {target!r}")


def _checked_length(accumulation_length: float) -> float:
    if not accumulation_length > 0.0:
        raise ValueError(f"accumulation_length must be positive, got {accumulation_length!r}")
    return float(accumulation_length)


def cast_min_log2_scale(
    log_mean: float | torch.Tensor, log_std: float | torch.Tensor, lambda_min: float, target: float
) -> float | torch.Tensor:
    """Theorem 2 solved for α: ln α ≥ ln λmin − μ − √2 σ erfinv(2γ' − 1), returned as log2 α (a tensor, unread, for
    tensors)."""
    ln_alpha = math.log(lambda_min) - log_mean - _SQRT2 * log_std * erfinv(2.0 * target - 1.0)
    return ln_alpha / math.log(2.0)


def cast_underflow_rate(log2_scale: float, log_mean: float, log_std: float, lambda_min: float) -> float:
    """Theorem 2: γ(α) = ½ (1 + erf((ln λmin − μ − ln α) / (√2 σ))), with α = 2^log2_scale."""
    distance = math.log(lambda_min) - log_mean - log2_scale * math.log(2.0)
    if log_std <= 0.0:  # every nonzero value has one magnitude
        return 1.0 if distance > 0.0 else 0.0
    return 0.5 * (1.0 + math.erf(distance / (_SQRT2 * log_std)))


def overflow_max_log2_scale(largest_output: float | torch.Tensor, lambda_max: float) -> torch.Tensor:
    """Real log2 of the bound on α from α · largest_output < λmax (``inf`` when unconstrained), on the device of
    ``largest_output`` (a float: the CPU), unread."""
    largest = as_float64(largest_output)
    return where_or((largest > 0.0) & (largest < math.inf), torch.log2(divide(lambda_max, largest)), math.inf)


def choose_log2_scale(
    lower: float | torch.Tensor, upper: float | torch.Tensor, ceiling: int | torch.Tensor | None = None
) -> torch.Tensor:
    """Pick the exponent of a power-of-two scale (paper §4.2), on the device of ``lower``, unread.

    The smallest power of two meeting the underflow bound ``lower`` (rounded **up**), but not
    below 2^0; less than 2^0 only when the strict overflow bound ``upper`` (``inf`` where nothing
    bounds it, never NaN) allows no scale ≥ 1 (rounded **down**, so that α < 2^upper holds strictly).
    ``ceiling`` caps the result. Floats are taken as float64 values on the CPU; the result is a 0-dim
    float64 tensor.
    """
    lower = as_float64(lower)
    return below_bounds(
        sufficient_log2_scale(torch.ceil(lower), finite(lower)), highest_below(upper, lower.device), ceiling
    )


def sufficient_log2_scale(rounded_up: torch.Tensor, is_finite: torch.Tensor) -> torch.Tensor:
    """The exponent :func:`choose_log2_scale` takes before any bound, from the underflow bound ``lower`` rounded up and
    whether it is finite (parts a decision uses again): ``ceil(lower)``, at least 0 (0 where not finite)."""
    return where_or(is_finite, rounded_up.clamp_min(0.0), 0.0)


def highest_below(upper: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The largest integer exponent strictly below the overflow bound ``upper`` (0-dim, float64, on ``device``)."""
    return torch.ceil(as_float64(upper, device)) - 1.0


def below_bounds(
    exponent: torch.Tensor, highest: torch.Tensor, ceiling: int | torch.Tensor | None = None
) -> torch.Tensor:
    """``exponent`` lowered to ``highest`` (:func:`highest_below` an overflow bound) and to ``ceiling``."""
    exponent = torch.minimum(exponent, highest)
    if ceiling is None:
        return exponent
    return exponent.clamp(max=ceiling) if not isinstance(ceiling, torch.Tensor) else torch.minimum(exponent, ceiling)


def as_float64(value: float | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``value`` as a 0-dim float64 tensor on ``device`` (a tensor's own by default; the CPU for a Python number):
    a number is filled in there, not copied from the host."""
    if isinstance(value, torch.Tensor):
        return value.to(device or value.device, torch.float64)
    return torch.full((), value, dtype=torch.float64, device=device)


def where_or(condition: torch.Tensor, values: torch.Tensor, otherwise: float) -> torch.Tensor:
    """``torch.where(condition, values, otherwise)``, the number ``otherwise`` a constant of ``values``' dtype and
    device made once (a Python number is wrapped in a new tensor on every call)."""
    return torch.where(condition, values, constant(otherwise, values.device, values.dtype))


def finite(values: torch.Tensor) -> torch.Tensor:
    """Where ``values`` are finite: two kernels (``torch.isfinite`` of a float tensor runs four)."""
    return values.abs() < math.inf


def divide(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` rounded once, as in Python floats (``float / tensor`` multiplies by a reciprocal):
    one kernel, the numerator a constant of the denominator's dtype on its device."""
    return torch.div(constant(numerator, denominator.device, denominator.dtype), denominator)


def branch_log2_scale(incoming: torch.Tensor, largest_true_value: torch.Tensor, lambda_max: float) -> torch.Tensor:
    """Algorithm 1, line 17: the common scale for gradients summed at a branch, on their device (nothing is read).

    ``incoming`` holds the parts' exponents α_i (a float64 vector), ``largest_true_value`` max_i(max|∇X_i| / α_i)
    (or their sum, for a sum). Returns the largest α_j with 2^α_j · largest_true_value < λmax, a 0-dim tensor; if
    none fits, the smallest halved until one does. A non-finite or zero ``largest_true_value`` bounds nothing.
    """
    bounded = (largest_true_value > 0.0) & finite(largest_true_value)
    bound = where_or(bounded, torch.log2(lambda_max / largest_true_value), math.inf)
    fits = incoming < bound
    largest_fitting = where_or(fits, incoming, -math.inf).amax()
    return torch.where(fits.any(), largest_fitting, torch.minimum(incoming.amin(), torch.ceil(bound) - 1.0))


# --- Model-free: order statistics of exact values ---------------------------------------------

# Largest sample taken per decision: huge gradients are subsampled with a fixed stride.
SAMPLE_LIMIT = 2**20
# Risk accepted that the chosen order statistic lies above the target quantile.
CONFIDENCE_RISK = 0.1


def sample_min_log2_scale(values: torch.Tensor, lambda_min: float, target: float) -> torch.Tensor:
    """The real log2 of the smallest scale with at most ``target`` of the nonzero ``|values|`` below ``lambda_min``.

    Model-free (no distribution assumed): read off an order statistic of the magnitudes, which
    are exact values of a gradient at its current scale. Chosen to hold for the distribution the
    values are drawn from (the scale is reused on later iterations, and ``values`` may be a slice
    or, above :data:`SAMPLE_LIMIT` elements, a strided subsample), not only for this sample:

    - with n nonzero values, the k-th smallest x₍ₖ₎ for the largest k with
      P(Binomial(n, target) < k) ≤ :data:`CONFIDENCE_RISK`, so that F(x₍ₖ₎) ≤ target with
      probability ≥ 0.9 (k ≈ n·target − 1.28 √(n·target) for large n);
    - when even the minimum is not that safe (n below ≈ 2.3 / target), the minimum scaled down
      linearly, x₍₁₎ · target / u with u = 1 − 0.1^(1/n) the 90% upper bound on F(x₍₁₎): exact for
      densities flat near zero (Gaussian, Laplace, long sums), conservative for log-normal ones.

    A 0-dim float64 tensor on the values' device, unread; ``-inf`` if all values are zero (no scale is needed).
    """
    return ExactSample(values).min_log2_scale(lambda_min, target)


def sample_underflow_rate(values: torch.Tensor, log2_scale: int, lambda_min: float) -> float:
    """The fraction of the nonzero ``values`` whose magnitude times ``2**log2_scale`` is below ``lambda_min``.

    The measured counterpart of :func:`gemm_underflow_rate`; 0 if all are zero. One host sync.
    """
    return counted_rate(*torch.stack(ExactSample(values).underflow_count(log2_scale, lambda_min)).tolist())


class ExactSample:
    """Exact values of a gradient, prepared once for :meth:`min_log2_scale` and :meth:`underflow_count`.

    An update asks both of every probe (the scale, then the rate measured at the scale chosen):
    the magnitudes and their nonzero count are taken once, on the values' device; nothing is read.

    Attributes:
        nonzero_count: How many values are nonzero (and not NaN), a 0-dim int64 tensor.
    """

    def __init__(self, values: torch.Tensor) -> None:
        magnitudes = _sample(values).abs().float()
        nonzero = magnitudes > 0
        self._positive = where_or(nonzero, magnitudes, math.inf)  # zeros (and NaN) never count
        self.nonzero_count = nonzero.sum()  # int64: a float32 sum of booleans measured 2.5x slower

    def smallest(self, target: float) -> torch.Tensor:
        """The smallest magnitudes, ascending, as many as any rank :meth:`min_log2_scale` may pick for ``target``."""
        _check_target(target)
        positive = self._positive
        # Any admissible rank is at most n·target ≤ numel·target: take only that many smallest values.
        return positive.topk(min(positive.numel(), math.floor(target * positive.numel()) + 1), largest=False).values

    def min_log2_scale(self, lambda_min: float, target: float) -> torch.Tensor:
        """:func:`sample_min_log2_scale` of these values: the order statistic picked on the device."""
        smallest = self.smallest(target).double()
        if not smallest.numel():
            return torch.full((), -math.inf, dtype=torch.float64, device=smallest.device)
        n = self.nonzero_count
        rank = torch.searchsorted(rank_breakpoints(smallest.numel(), target, CONFIDENCE_RISK, n.device), n, right=True)
        below_minimum = smallest[0] * -target / torch.expm1(divide(math.log(CONFIDENCE_RISK), n.double()))
        # rank k > 0 picks the k-th smallest; taken (indexing by a 0-dim tensor would read it)
        threshold = torch.take(torch.cat([below_minimum.view(1), smallest]), rank)
        return torch.log2(divide(lambda_min, threshold))  # no nonzero value: the minimum is inf, and -inf is returned

    def underflow_count(self, log2_scale: int | torch.Tensor, lambda_min: float) -> tuple[torch.Tensor, torch.Tensor]:
        """How many of these values fall below ``lambda_min`` at the scale ``2**log2_scale``, and how many are
        nonzero: 0-dim tensors on the device, unread (:func:`counted_rate` of them, as read, is the rate)."""
        return underflow_counts([self], log2_scale, lambda_min)[0]


def underflow_counts(
    samples: Sequence[ExactSample], log2_scale: int | torch.Tensor, lambda_min: float
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:meth:`ExactSample.underflow_count` of each of ``samples`` at one scale (a decision's probes), its threshold
    made once."""
    # |v|·2^k < λ ⟺ |v| < λ·2^-k: exact, and no product can overflow or underflow first. A 0-dim
    # threshold is compared in the values' fp32, as a Python scalar would be.
    threshold = lambda_min * (torch.exp2(-log2_scale) if isinstance(log2_scale, torch.Tensor) else 2.0**-log2_scale)
    return [((sample._positive < threshold).sum(), sample.nonzero_count) for sample in samples]


def counted_rate(below: float, nonzero: float) -> float:
    """The fraction of nonzero values below the threshold, from the two counts (0 where none is nonzero)."""
    return below / nonzero if nonzero else 0.0


@functools.lru_cache(maxsize=256)
def constant(value: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 0-dim ``value`` on ``device``, filled in there once per (value, device, dtype); never written to.
    (As a Python scalar, ``where`` would make it every call, and a division would multiply by a reciprocal.)

    Raises:
        TypeError: ``value`` is a tensor: filling from it would read it to the host, and the cache would keep it by
            identity (checked where the cache misses, so at no cost per call).
    """
    if isinstance(value, torch.Tensor):
        raise TypeError(f"constant() takes a Python number, got a tensor {value!r}: use the tensor itself")
    return torch.full((), value, dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def rank_breakpoints(largest: int, rate: float, risk: float, device: torch.device) -> torch.Tensor:
    """For k = 1..``largest``, the smallest count n whose :func:`confident_rank` reaches k, on ``device``
    (int64, ascending): a count's rank is how many of them it reaches, one ``searchsorted`` on the device.

    Found once per sample size (cached), where they are used (no copy from the host): by bisection on n,
    every k at once, a fixed number of halvings (nothing read), over the binomial CDF from ``lgamma``.
    Then the k-th smallest of n samples lies below the distribution's ``rate`` quantile with probability
    at least 1 − risk.
    """
    with _disable_current_modes():  # not what a dispatch mode (the fp16 emulation) models
        return _breakpoints(largest, rate, risk, device)


def _breakpoints(largest: int, rate: float, risk: float, device: torch.device) -> torch.Tensor:
    k = torch.arange(1, largest + 1, dtype=torch.float64, device=device)
    low = k - 1.0  # P(Binomial(n, rate) ≤ k − 1) = 1 > risk for n ≤ k − 1
    high = torch.ceil((k + 10.0 * k.sqrt() + 30.0) / rate)  # far in the tail: the CDF is below any risk there
    # halvings to width 1, for every k
    steps = math.ceil(math.log2((largest + 10.0 * math.sqrt(largest) + 30.0) / rate + 1.0))
    for start in range(0, largest, 1024):  # a bounded matrix of terms at a time
        rows = slice(start, min(start + 1024, largest))
        for _ in range(steps):
            middle = torch.floor((low[rows] + high[rows]) / 2.0)
            within = _log_binomial_cdf(middle, k[rows] - 1.0, rows.stop - 1, rate) <= math.log(risk)
            high[rows], low[rows] = torch.where(within, middle, high[rows]), torch.where(within, low[rows], middle)
    return high.to(torch.int64)


def _log_binomial_cdf(n: torch.Tensor, at: torch.Tensor, most: int, rate: float) -> torch.Tensor:
    """log P(Binomial(n, rate) ≤ at) where ``at`` is below the mode, elementwise over the float64 vectors ``n`` and
    ``at`` (integers, ``most`` at most); 0 elsewhere, where the CDF is at least P(X ≤ ⌊n·rate⌋), well above any
    risk used here.

    Summed over the terms j ≤ at within 24·√at + 40 of it: below the mode the terms fall geometrically
    below ``at`` (by about 1.28 / √at each near a 10% tail), and the rest is below 1e-13 of the sum.
    """
    window = 24 * math.isqrt(most + 1) + 40
    j = at[:, None] - torch.arange(window, dtype=torch.float64, device=at.device)[None, :]
    below_mode = at < torch.floor((n + 1.0) * rate)
    n = n[:, None]
    log_pmf = (
        torch.lgamma(n + 1.0)
        - torch.lgamma(j.clamp_min(0.0) + 1.0)
        - torch.lgamma((n - j).clamp_min(0.0) + 1.0)
        + j * math.log(rate)
        + (n - j) * math.log1p(-rate)
    )
    return torch.where(below_mode, torch.logsumexp(torch.where(j >= 0.0, log_pmf, -math.inf), dim=1), 0.0)


def confident_rank(n: int, rate: float, risk: float) -> int:
    """The largest k with P(Binomial(n, rate) ≤ k − 1) ≤ risk (0 if there is none), as :func:`rank_breakpoints` give
    it."""
    breakpoints = rank_breakpoints(math.floor(rate * n) + 1, rate, risk, torch.device("cpu"))
    return int(torch.searchsorted(breakpoints, torch.tensor(n), right=True))


def _sample(values: torch.Tensor) -> torch.Tensor:
    flat = (values.detach() if values.requires_grad else values).reshape(-1)
    if flat.numel() > SAMPLE_LIMIT:
        flat = flat[:: math.ceil(flat.numel() / SAMPLE_LIMIT)]
    return flat
