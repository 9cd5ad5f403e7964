"""Underflow statistics where the paper's models do not fit (issue #8, item 2).

Monte Carlo against exact fp32 gradients: the measured underflow at the chosen power-of-two scale
must stay ≤ 2γ' for Gaussian, log-normal, Laplace, sparse and softmax cross-entropy gradients and
accumulation lengths 1..4096, where Theorem 1 / Theorem 2 (the rules before) exceed it.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from scipy import integrate, special, stats
from torch import nn

from gs_lightning.analysis import underflow_mc as mc
from gs_lightning.scaling import probes, underflow

LAMBDA = mc.LAMBDA_MIN
TARGET = mc.TARGET
LIMIT = 2 * TARGET  # issue #8's bar for measured underflow


# --- the exact distribution of a sum of N Gaussian products -------------------------------------


@pytest.mark.parametrize("x", [1e-5, 1e-3, 0.1, 2.0])
def test_product_sum_cdf_matches_closed_forms(x: float) -> None:
    # N = 2 is Laplace(0, 1); N = 1 the product-normal law, density K0(|z|)/π; N = 3 variance-gamma.
    assert underflow.product_sum_cdf(x, 2) == pytest.approx(-math.expm1(-x), rel=1e-10)
    product_normal = 2 / math.pi * integrate.quad(special.k0, 0, x)[0]
    assert underflow.product_sum_cdf(x, 1) == pytest.approx(product_normal, rel=1e-8)
    variance_gamma = integrate.quad(
        lambda z: 2 * z * special.kv(1, z) / (math.sqrt(math.pi) * special.gamma(1.5) * 2), 0, x
    )[0]
    assert underflow.product_sum_cdf(x, 3) == pytest.approx(variance_gamma, rel=1e-7)


def test_product_sum_tends_to_theorem1_for_long_sums() -> None:
    for n, tolerance in ((256, 5e-3), (4095, 3e-4)):
        x = math.sqrt(n) * 0.01  # the γ ≈ 0.8% point
        assert underflow.product_sum_cdf(x, n) == pytest.approx(math.erf(0.01 / math.sqrt(2)), rel=tolerance)
    # From GAUSSIAN_ACCUMULATION_LENGTH on, Theorem 1 itself: no change to the paper's scales.
    sigma = 3e-6
    paper = underflow.gemm_min_log2_scale(sigma, LAMBDA, TARGET)
    assert underflow.gemm_min_log2_scale(sigma, LAMBDA, TARGET, accumulation_length=4096) == paper
    assert float(underflow.gemm_min_log2_scale(sigma, LAMBDA, TARGET, accumulation_length=4095)) == pytest.approx(
        float(paper), abs=1e-3
    )


@pytest.mark.parametrize("n", [1, 2, 4, 16, 256])
def test_quantile_inverts_cdf_and_rate_matches_scale(n: int) -> None:
    q = underflow.product_sum_quantile(TARGET, n)
    assert underflow.product_sum_cdf(q, n) == pytest.approx(TARGET, rel=1e-6)
    sigma = 1e-7
    k = underflow.choose_log2_scale(
        underflow.gemm_min_log2_scale(sigma, LAMBDA, TARGET, accumulation_length=n), math.inf
    )
    rates = [underflow.gemm_underflow_rate(e, sigma, LAMBDA, accumulation_length=n) for e in (k, k - 1)]
    assert rates[0] <= TARGET < rates[1]


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="target"):
        underflow.gemm_min_log2_scale(1e-3, LAMBDA, 1.5, accumulation_length=4)
    with pytest.raises(ValueError, match="accumulation_length"):
        underflow.gemm_min_log2_scale(1e-3, LAMBDA, TARGET, accumulation_length=0)
    with pytest.raises(ValueError, match="target"):
        underflow.sample_min_log2_scale(torch.ones(4), LAMBDA, 0.0)


@pytest.mark.parametrize("n", [1, 2, 4, 16, 256, 4096])
def test_gemm_model_meets_target_for_gaussian_operands(n: int) -> None:
    """∇X = ∇Y·W with Gaussian ∇Y and W: Theorem 1 misses for N ≤ 2, the exact model never does."""
    generator = torch.Generator().manual_seed(n)
    grad = torch.randn(256, n, generator=generator) * 2.0**-24
    weight = torch.randn(n, 256, generator=generator)
    exact = grad @ weight
    sigma = underflow.gemm_sigma(n, grad.pow(2).mean().sqrt().item(), weight.pow(2).mean().sqrt().item())
    k = underflow.choose_log2_scale(
        underflow.gemm_min_log2_scale(sigma, LAMBDA, TARGET, accumulation_length=n), math.inf
    )
    assert underflow.sample_underflow_rate(exact, k, LAMBDA) <= LIMIT
    paper = underflow.choose_log2_scale(underflow.gemm_min_log2_scale(sigma, LAMBDA, TARGET), math.inf)
    if n == 1:
        assert underflow.sample_underflow_rate(exact, paper, LAMBDA) > LIMIT


# --- the two numbers: the failing baselines, and the fix ---------------------------------


def test_cast_of_gaussian_gradient_theorem2_fails_order_statistic_holds() -> None:
    """Issue #8: Theorem 2's log-normal fit on a Gaussian gradient at a cast measured 7.8e-3."""
    theorem2, order_statistic = mc.cast_rates("gaussian")
    assert theorem2 > 4 * TARGET
    assert order_statistic <= LIMIT


def test_linear_1024_to_1_input_gradient() -> None:
    """Issue #8: the input gradient of Linear(1024, 1), N = 1, measured 6.4e-3 under Theorem 1.

    Each element of ∇X is one product ∇Y_r · W_j of two Gaussians (a trained head's weights).
    """
    generator = torch.Generator().manual_seed(0)
    head = nn.Linear(1024, 1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, 1024, generator=generator) * 0.03)
    x = torch.randn(256, 1024, generator=generator, requires_grad=True)
    y = head(x)
    node, samples = y.grad_fn, []
    node.register_prehook(lambda grads: samples.append(probes.probe(node, grads[0], 1, None, elements=2**12)))
    grad = torch.randn(256, 1, generator=generator) * 2.0**-24
    y.backward(grad)
    sigma = underflow.gemm_sigma(1, grad.pow(2).mean().sqrt().item(), head.weight.pow(2).mean().sqrt().item())

    def measured(lower: float) -> float:
        return underflow.sample_underflow_rate(x.grad, underflow.choose_log2_scale(lower, math.inf), LAMBDA)

    assert measured(underflow.gemm_min_log2_scale(sigma, LAMBDA, TARGET)) > 1.5 * LIMIT
    assert measured(underflow.gemm_min_log2_scale(sigma, LAMBDA, TARGET, accumulation_length=1)) <= LIMIT
    assert measured(underflow.sample_min_log2_scale(samples[0], LAMBDA, TARGET)) <= LIMIT


# --- Monte Carlo over gradient distributions × accumulation lengths × operators -------------------


@pytest.mark.parametrize("op", sorted(mc.OPS))
def test_probe_and_max_rule_meet_target_everywhere(op: str) -> None:
    """The probe sees 2^11 of the 2^14 values of ∇X; its scale, alone or maxed with the model's, holds for all."""
    failures = []
    for kind in mc.GRADIENTS:
        for n in mc.ACCUMULATION_LENGTHS:
            rates = mc.gemm_rates(mc.gemm_trial(op, kind, n, rows=128, columns=128, probe_elements=2**11, seed=1))
            if max(rates.probe, rates.combined) > LIMIT:
                failures.append((kind, n, rates))
            if kind == "gaussian" and rates.model > LIMIT:
                failures.append((kind, n, rates))
    assert not failures


def test_theorem1_alone_misses_for_non_gaussian_gradients() -> None:
    """What the probe is for: Theorem 1 leaves 10-200× γ' for softmax cross-entropy gradients at small N."""
    rates = mc.gemm_rates(mc.gemm_trial("linear", "softmax-ce", 4, rows=128, columns=128, probe_elements=2**11))
    assert rates.paper > 10 * LIMIT
    assert rates.combined <= LIMIT


# --- the order statistic ---------------------------------------------------------------------------


def test_sample_underflow_rate_counts_nonzero_values_below_lambda() -> None:
    values = torch.tensor([0.0, 2.0**-15, 2.0**-14, 2.0**-13, -(2.0**-16)])
    assert underflow.sample_underflow_rate(values, 0, LAMBDA) == 0.5
    assert underflow.sample_underflow_rate(values, 1, LAMBDA) == 0.25
    assert underflow.sample_underflow_rate(torch.zeros(3), 5, LAMBDA) == 0.0


def test_rate_at_a_scale_counts_as_every_value_does() -> None:
    """:meth:`ExactSample.underflow_count` at scales around the one chosen: the same rate as a pass over all
    values, zeros, ties and NaN included."""
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(5000, generator=generator) * 2.0**-20
    values[torch.rand(5000, generator=generator) < 0.2] = 0.0
    values[:1000] = values[:1000].mul(2.0**30).round().mul(2.0**-30)  # ties
    values[7] = math.nan
    positive = values.abs()[values.abs() > 0]
    for target in (1e-3, 1e-2):
        sample = underflow.ExactSample(values)
        chosen = math.ceil(sample.min_log2_scale(LAMBDA, target))
        for log2_scale in range(chosen - 4, chosen + 4):
            expected = float((positive * 2.0**log2_scale < LAMBDA).sum()) / positive.numel()
            assert (
                underflow.counted_rate(
                    *(float(c) for c in sample.underflow_count(torch.tensor(float(log2_scale)), LAMBDA))
                )
                == expected
            )
            assert underflow.sample_underflow_rate(values, log2_scale, LAMBDA) == expected


def test_sample_min_log2_scale_on_known_values() -> None:
    assert underflow.sample_min_log2_scale(torch.zeros(10), LAMBDA, TARGET) == -math.inf
    # 2^20 values 1..2^20 (scaled): the rank is the confident one, and it leaves ≤ target below λ.
    values = torch.arange(1, 2**20 + 1, dtype=torch.float32) * 2.0**-40
    n = values.numel()
    rank = underflow.confident_rank(n, TARGET, underflow.CONFIDENCE_RISK)
    assert stats.binom.cdf(rank - 1, n, TARGET) <= underflow.CONFIDENCE_RISK < stats.binom.cdf(rank, n, TARGET)
    lower = underflow.sample_min_log2_scale(values, LAMBDA, TARGET)
    assert float(lower) == pytest.approx(math.log2(LAMBDA / (rank * 2.0**-40)))
    assert underflow.sample_underflow_rate(values, math.ceil(lower), LAMBDA) <= TARGET


def test_huge_tensors_are_subsampled_with_a_stride() -> None:
    values = torch.randn(3 * underflow.SAMPLE_LIMIT, generator=torch.Generator().manual_seed(4))
    strided = values[:: math.ceil(values.numel() / underflow.SAMPLE_LIMIT)]
    assert underflow.sample_min_log2_scale(values, LAMBDA, TARGET) == underflow.sample_min_log2_scale(
        strided, LAMBDA, TARGET
    )


_DISTRIBUTIONS = {
    "gaussian": lambda n, g: torch.randn(n, generator=g),
    "laplace": lambda n, g: torch.log1p(-torch.rand(n, generator=g)),
    "log-normal": lambda n, g: torch.exp(2 * torch.randn(n, generator=g)),
    "product-normal": lambda n, g: torch.randn(n, generator=g) * torch.randn(n, generator=g),
}


@pytest.mark.parametrize("kind", sorted(_DISTRIBUTIONS))
def test_small_samples_generalise(kind: str) -> None:
    """Scale chosen on n values, measured on the distribution (a 2^21 reference draw): the scale is reused."""
    generator = torch.Generator().manual_seed(5)
    draw = _DISTRIBUTIONS[kind]
    reference = draw(2**21, generator).abs().sort().values
    for n in (50, 300, 3000):
        rates = []
        for _ in range(100):
            k = underflow.choose_log2_scale(
                underflow.sample_min_log2_scale(draw(n, generator) * 2.0**-24, LAMBDA, TARGET), math.inf
            )
            threshold = torch.tensor(LAMBDA * 2.0**-k / 2.0**-24)
            rates.append(torch.searchsorted(reference, threshold).item() / reference.numel())
        rates = torch.tensor(rates)
        assert rates.mean() <= TARGET, (n, rates.mean())
        assert rates.quantile(0.9) <= LIMIT, (n, rates.quantile(0.9))


# --- the paper's models (Theorems 1 and 2) and the choice of a power of two ------------------


def _rate(values: torch.Tensor, threshold: float) -> float:
    return float((values.abs() <= threshold).double().mean())


@pytest.mark.parametrize("sigma", [1e-7, 3e-6, 2e-4])
def test_theorem1_scale_meets_target_on_normal_samples(sigma: float) -> None:
    samples = torch.randn(2_000_000, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * sigma
    k = underflow.choose_log2_scale(underflow.gemm_min_log2_scale(sigma, LAMBDA, TARGET), math.inf)
    assert k > 0
    assert _rate(samples * 2.0**k, LAMBDA) <= TARGET
    assert _rate(samples * 2.0 ** (k - 1), LAMBDA) > TARGET
    assert (
        underflow.gemm_underflow_rate(k, sigma, LAMBDA) <= TARGET < underflow.gemm_underflow_rate(k - 1, sigma, LAMBDA)
    )


@pytest.mark.parametrize(("mu", "sigma"), [(-20.0, 1.5), (-14.0, 3.0)])
def test_theorem2_scale_meets_target_on_lognormal_samples(mu: float, sigma: float) -> None:
    samples = torch.exp(
        mu + sigma * torch.randn(2_000_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    )
    k = underflow.choose_log2_scale(underflow.cast_min_log2_scale(mu, sigma, LAMBDA, TARGET), math.inf)
    assert _rate(samples * 2.0**k, LAMBDA) <= TARGET
    assert _rate(samples * 2.0 ** (k - 1), LAMBDA) > TARGET


def test_scale_rounding_and_clamping() -> None:
    assert underflow.choose_log2_scale(3.2, math.inf) == 4  # underflow bound rounded up
    assert underflow.choose_log2_scale(-5.0, math.inf) == 0  # never below 1 without overflow
    assert underflow.choose_log2_scale(10.0, 6.5) == 6  # overflow bound rounded down
    assert underflow.choose_log2_scale(10.0, 6.0) == 5  # strict: α < 2^6
    assert underflow.choose_log2_scale(0.0, -2.3) == -3  # overflow forces a scale below 1


def _branch(incoming: list[int], largest: float) -> float:
    as_tensor = partial(torch.tensor, dtype=torch.float64)
    return underflow.branch_log2_scale(as_tensor(incoming), as_tensor(largest), 2.0**16).item()


def test_branch_scale_is_the_largest_incoming_that_fits() -> None:
    assert _branch([5, 9, 2], 2.0**-4) == 9
    assert _branch([5, 9, 2], 2.0**10) == 5
    assert _branch([5, 9], 2.0**20) == -5  # halve the smallest until it fits
    assert _branch([5, 9], 2.0**6) == 9  # strict: 2^9 · 2^6 < 2^16, but 2^10 · 2^6 would not be
    assert _branch([5, 9], 2.0**7) == 5
    assert _branch([5, 9], math.nan) == _branch([5, 9], math.inf) == _branch([5, 9], 0.0) == 9  # nothing to bound


def test_device_arithmetic_constants_round_once_keep_dtypes_and_refuse_tensors() -> None:
    """The decisions' constants: ``divide`` rounds once, as Python floats do; ``where_or`` keeps the values' dtype;
    a tensor is refused (filling a constant from it would read it to the host)."""
    denominators = torch.tensor([3.0, 7.0, 1e-300, 2.0**-1074, 6.1e-5, -0.0], dtype=torch.float64)
    for numerator in (6.103515625e-05, 65504.0 * math.sqrt(3.0), math.log(0.1)):
        quotients = underflow.divide(numerator, denominators)
        assert quotients.dtype == torch.float64
        assert quotients.tolist() == [
            numerator / d if d else math.copysign(math.inf, numerator) * math.copysign(1.0, d)
            for d in denominators.tolist()
        ]
    for dtype in (torch.float32, torch.float64):
        chosen = underflow.where_or(torch.tensor([True, False]), torch.ones(2, dtype=dtype), -math.inf)
        assert chosen.dtype == dtype and chosen.tolist() == [1.0, -math.inf]
    with pytest.raises(TypeError, match="takes a Python number, got a tensor"):
        underflow.constant(torch.tensor(2), torch.device("cpu"), torch.int64)
