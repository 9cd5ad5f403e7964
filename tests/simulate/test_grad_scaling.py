"""Current and MX block scaling of fp8 gradients, the per-tensor oracle, and the entering-gradient emulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning.simulate import (
    CurrentScaling,
    MXBlockScaling,
    UnderflowMeter,
    emulate,
    largest_pow2_scale,
    pow2_oracle_underflow,
    round_to,
)

E5M2, E4M3 = torch.float8_e5m2, torch.float8_e4m3fn


def _spread(seed: int, n: int = 4096) -> torch.Tensor:
    """Values over 40 binades, signed, some zeros: many underflow in any fp8 format at any one scale."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.exp2(torch.rand(n, generator=generator) * -40) * torch.randn(n, generator=generator).sign()
    values[::97] = 0.0
    return values


# --- the oracle and current scaling --------------------------------------------------------------


def test_largest_pow2_scale_is_exact_at_the_boundaries() -> None:
    amax = torch.tensor([1.0, 448.0, 448.0 * (1 + 2**-20), 0.3, 0.0, float("inf"), 2.0**-30])
    assert largest_pow2_scale(amax, 448.0).tolist() == [256.0, 1.0, 0.5, 1024.0, 1.0, 1.0, 2.0**38]


@pytest.mark.parametrize("fmt", [E5M2, E4M3])
def test_power_of_two_current_scaling_underflows_exactly_what_the_oracle_says(fmt: torch.dtype) -> None:
    meter = UnderflowMeter(oracle_format=fmt)
    tensors = [_spread(seed) * magnitude for seed, magnitude in enumerate((1.0, 1e-3, 5e4, 3e-7))]
    for values in tensors:
        meter.add(values, CurrentScaling(power_of_two=True).quantize(values, fmt, torch.float32))
    measured, oracle = meter.collect_with_oracle()
    assert measured == oracle and all(0.01 < fraction < 0.9 for fraction in oracle), (measured, oracle)
    # The oracle is the best power of two: half the scale underflows more, double it overflows.
    values = tensors[0]
    scale = largest_pow2_scale(values.abs().max(), torch.finfo(fmt).max)
    lost = pow2_oracle_underflow(values, fmt)
    assert ((round_to(values * scale / 2, fmt, torch.float32) == 0) & (values != 0)).sum() > lost
    assert (values.abs() * scale * 2).max() > torch.finfo(fmt).max


def test_te_current_scaling_scales_to_fp8_max_and_underflows_no_more_than_the_oracle() -> None:
    values = _spread(0) * 3.0  # amax 3: fp8_max / 3 is not a power of two
    scaling = CurrentScaling()
    assert scaling.scale(values, E5M2).item() == pytest.approx(57344.0 / values.abs().max().item())
    meter = UnderflowMeter(oracle_format=E5M2)
    meter.add(values, scaling.quantize(values, E5M2, torch.float32))
    (measured,), (oracle,) = meter.collect_with_oracle()
    assert measured < oracle  # its scale exceeds the best power of two by up to 2x
    assert scaling.scale(torch.zeros(3), E5M2).item() == 1.0  # TE: scale 1 where amax is 0


# --- MX block scaling ----------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "emax"), [(E5M2, 15), (E4M3, 8)])
def test_an_mx_blocks_scale_is_the_power_of_two_its_largest_element_needs(fmt: torch.dtype, emax: int) -> None:
    largest = torch.tensor([1.0, 1.5, 3.0, 2.0**-40, 7e3, 0.0])
    blocks = torch.rand(len(largest), 32, generator=torch.Generator().manual_seed(0)) * 0.5 * largest[:, None]
    blocks[:, 5] = -largest  # the largest magnitude, negative
    scales = MXBlockScaling.block_scales(blocks, fmt)
    expected = [2.0 ** (torch.floor(torch.log2(a)).item() - emax) if a > 0 else 1.0 for a in largest]
    assert scales.tolist() == expected
    # Scaled, the largest element lands in the element format's top binade [2^emax, 2^(emax+1)).
    top = largest[:5] / scales[:5]
    assert ((top >= 2.0**emax) & (top < 2.0 ** (emax + 1))).all()


def test_mx_blocks_run_along_the_given_dimensions_in_groups_of_32() -> None:
    values = torch.ones(4, 64)
    values[0, 0] = 2.0**20  # one large value: only its own block of 32 along dim 1 loses its small ones
    along_rows = MXBlockScaling().quantize(values, E4M3, torch.float32, (1,))
    assert (along_rows[0, 1:32] == 0).all() and (along_rows[0, 32:] == 1).all() and (along_rows[1:] == 1).all()
    along_columns = MXBlockScaling().quantize(values, E4M3, torch.float32, (0,))  # blocks of 4 (padded): column 0 only
    assert (along_columns[1:, 0] == 0).all() and (along_columns[:, 1:] == 1).all()
    assert along_rows[0, 0] == along_columns[0, 0] == 2.0**20
    with pytest.raises(ValueError, match="block_dims must name the reduction dimension"):
        MXBlockScaling().quantize(values, E4M3, torch.float32, ())


# --- the entering-gradient emulation --------------------------------------------------------------


def test_entering_mode_casts_the_gradient_entering_each_gemm_not_the_one_it_produces() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    grad_y = torch.randn(4, 8) * 2.0 ** torch.randint(-22, 0, (4, 8))  # many values below e5m2's range
    meter = UnderflowMeter()
    with emulate(torch.bfloat16, E5M2, grad_rounding="entering", underflow=meter):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear(x)
        y.backward(grad_y.to(y.dtype))
    exact_y = grad_y.to(torch.bfloat16).float()
    cast_y = round_to(exact_y, E5M2, torch.float32)
    w, xb = linear.weight.to(torch.bfloat16).float(), x.detach().to(torch.bfloat16).float()
    assert torch.equal(x.grad, (cast_y @ w).to(torch.bfloat16).float())
    assert torch.equal(linear.weight.grad, (cast_y.T @ xb).to(torch.bfloat16).float())
    assert torch.allclose(linear.bias.grad, exact_y.sum(0), rtol=2**-7, atol=0)  # a bf16 sum of the uncast ∇Y
    assert not torch.equal(cast_y @ w, exact_y @ w)  # the cast changed ∇Y ...
    assert not torch.equal(x.grad, round_to(x.grad, E5M2, torch.float32))  # ... and ∇X was not cast
    expected_underflow = ((exact_y != 0) & (cast_y == 0)).sum().item() / (exact_y != 0).sum().item()
    assert meter.collect() == pytest.approx([expected_underflow] * 2)  # ∇Y, cast for the ∇X and the ∇W GEMM


def test_entering_mode_blocks_a_convolutions_gradient_along_each_gemms_reduction() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 32, 3, padding=1, bias=False)
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    grad_y = torch.randn(2, 32, 4, 4) * 2.0 ** torch.randint(-12, 0, (2, 32, 4, 4))
    with emulate(torch.bfloat16, E4M3, grad_scaling=MXBlockScaling(), grad_rounding="entering"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = conv(x)
        y.backward(grad_y.to(y.dtype))
    exact_y = grad_y.to(torch.bfloat16).float()
    w, xb = conv.weight.to(torch.bfloat16).float(), x.detach().to(torch.bfloat16).float()
    over_channels = MXBlockScaling().quantize(exact_y, E4M3, torch.float32, (1,))
    over_positions = MXBlockScaling().quantize(exact_y, E4M3, torch.float32, (0, 2, 3))
    assert not torch.equal(over_channels, over_positions)
    assert torch.equal(
        x.grad, torch.nn.grad.conv2d_input(x.shape, w, over_channels, padding=1).to(torch.bfloat16).float()
    )
    assert torch.allclose(
        conv.weight.grad, torch.nn.grad.conv2d_weight(xb, w.shape, over_positions, padding=1).to(torch.bfloat16).float()
    )


def test_output_mode_still_rounds_what_the_gemm_produces() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    with emulate(torch.float16, E5M2), torch.autocast("cpu", dtype=torch.float16):
        F.linear(x, linear.weight).float().sum().backward()
    assert torch.equal(x.grad, round_to(x.grad, E5M2, torch.float32))


def test_bad_grad_rounding_and_oracle_format_name_what_was_expected() -> None:
    with pytest.raises(ValueError, match="grad_rounding must be 'output' or 'entering'"):
        emulate(torch.float16, E5M2, grad_rounding="input")
    with pytest.raises(ValueError, match="needs a grad_dtype other than dtype"):
        emulate(torch.bfloat16, grad_rounding="entering")
    with pytest.raises(ValueError, match="oracle_format must be None or one of"):
        UnderflowMeter(oracle_format=torch.int8)
    with pytest.raises(ValueError, match="power_of_two must be a bool"):
        CurrentScaling(power_of_two=1)
