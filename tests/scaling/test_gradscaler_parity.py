"""PyTorch's own GradScaler tests, run with ``GradientScaler(model)`` in place of ``GradScaler`` (issue 15).

Ported from pytorch/pytorch: ``test/test_torch.py`` (``TestTorchDeviceType.test_grad_scaling_*``, which
run on the CPU), ``test/test_cuda.py`` (``test_grad_scaling_scale``, ``test_grad_scale_will_not_overflow``,
``test_grad_scaler_pass_itself``, ``test_params_invalidated_with_grads_invalidated_between_unscale_and_step``,
CUDA-only there but not CUDA-specific) and ``test/test_optim.py``
(``test_grad_scaling_autocast_fused_optimizers``). Each test names its upstream test; the helpers
``_create_scaling_models_optimizers``, ``_create_scaling_case`` and ``_run_scaling_case`` are rewritten
here, since importing ``torch.testing._internal.common_cuda`` needs the test-only ``expecttest``.

Where upstream asserts a value only a ``GradScaler`` has (its one scale, its growth and backoff), the
port asserts the property that value protects, said in a comment there. The upstream loops inject
their overflow by writing inf into ``model[1].weight.grad`` after the backward; the fp32 loops here
also run with the overflow arising in the backward itself (``OVERFLOW_SOURCES``), as an fp16 overflow
does (the autocast matrix keeps upstream's way only: it is the slow one).

Not ported: ``test_grad_scaling_multigpu`` and ``test_grad_scaling_device_as_key`` (two CUDA devices);
``test_grad_scaler_deprecated_warning`` (the deprecation of ``torch.cuda.amp.GradScaler``'s name).
``test_grad_scaling_update_scale`` calls GradScaler's private kernel ``_amp_update_scale_``; its job,
backing off after an overflow and growing back after a clean interval, is ported onto
GradientScaler's back-off.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from itertools import chain

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning import GradientScaler
from gs_lightning.scaling.finite import unscale_and_check_

SKIP_ITER = 2  # upstream's skip_iter: the iteration whose step must be skipped
OVERFLOW_SOURCES = ["written_grad", "written_through_data", "written_through_numpy", "backward"]


def create_scaling_models_optimizers(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Upstream ``_create_scaling_models_optimizers``: a control and a scaling model with the same weights."""
    mod_control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    mod_scaling = copy.deepcopy(mod_control)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return (
        mod_control,
        mod_scaling,
        optimizer_ctor(mod_control.parameters(), **kwargs),
        optimizer_ctor(mod_scaling.parameters(), **kwargs),
    )


def create_scaling_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Upstream ``_create_scaling_case``: the models and optimizers, four batches of (8, 8) and MSELoss."""
    torch.manual_seed(0)
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return (*create_scaling_models_optimizers(optimizer_ctor, optimizer_kwargs), data, nn.MSELoss())


class Overflow:
    """Makes iteration ``SKIP_ITER``'s gradients non-finite in the scaling loop, when the scaler is enabled.

    ``"written_grad"`` is upstream's way: ``model[1].weight.grad.fill_(inf)`` after the backward;
    ``"written_through_data"`` and ``"written_through_numpy"`` write it as old code does, through
    ``.grad.data`` and ``.grad.numpy()``, which bump no version counter.
    ``"backward"``: the gradient reaching the model's output is made inf, so the backward itself
    produces the non-finite gradients. ``None``: no overflow. It also keeps the scales of every
    backward, for the check that scaling did happen.
    """

    def __init__(self, source: str | None) -> None:
        self.source = source
        self.scales: list[float] = []

    def _now(self, i: int, scaler: GradientScaler) -> bool:
        return i == SKIP_ITER and scaler.is_enabled()

    def in_backward(self, output: torch.Tensor, i: int, scaler: GradientScaler) -> None:
        """Call on the model's output after the forward."""
        if self.source == "backward" and self._now(i, scaler):
            output.register_hook(lambda grad: grad * float("inf"))

    def written(self, model: nn.Module, i: int, scaler: GradientScaler) -> None:
        """Call after the backward, where upstream writes its inf."""
        self.scales += scaler.scales().values()
        if not self._now(i, scaler):
            return
        grad = model[1].weight.grad
        if self.source == "written_grad":
            with torch.no_grad():
                grad.fill_(float("inf"))
        elif self.source == "written_through_data":  # no version counter sees these two
            grad.data.fill_(float("inf"))
        elif self.source == "written_through_numpy":
            grad.numpy()[0, 0] = float("inf")


def count_steps(optimizer: torch.optim.Optimizer) -> list[None]:
    """A list that grows by one with every step the optimizer takes."""
    steps: list[None] = []
    optimizer.register_step_post_hook(lambda *_: steps.append(None))
    return steps


def assert_same_training(mod_control, mod_scaling, opt_control, opt_scaling) -> None:
    """Gradients, optimizer state and weights equal, bit for bit.

    Upstream allows atol=1e-7 (1e-3 under autocast, against an fp32 control). Power-of-two scales are
    exact away from underflow and overflow, and the control here runs the same arithmetic (fp32, or
    the same fp16 autocast), so the runs are equal.
    """
    for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
        torch.testing.assert_close(s.grad, c.grad, rtol=0, atol=0)
        c_state, s_state = opt_control.state[c], opt_scaling.state[s]
        assert c_state.keys() == s_state.keys()
        for k in c_state:
            torch.testing.assert_close(s_state[k], c_state[k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(s, c, rtol=0, atol=0)


def run_scaling_case(
    run: Callable,
    unskipped: int,
    skipped: int,
    source: str | None = None,
    optimizer_ctor=torch.optim.SGD,
    optimizer_kwargs=None,
) -> None:
    """Upstream ``_run_scaling_case``: the control loop (no scaler) and the scaling loop from the same
    weights and data, with the scaler enabled and disabled (the same control flow must work both ways)."""
    for enabled in (True, False):
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn = create_scaling_case(
            optimizer_ctor, optimizer_kwargs
        )
        # update_interval=2: the run both decides scales and replays decided ones
        scaler = GradientScaler(mod_scaling, update_interval=2, enabled=enabled)
        steps = count_steps(opt_scaling)
        overflow = Overflow(source)
        run(data, mod_control, opt_control, scaler, loss_fn, overflow, False)
        scaler = run(data, mod_scaling, opt_scaling, scaler, loss_fn, overflow, True) or scaler
        # Upstream: get_scale() == 128 * growth**unskipped * backoff**skipped, the one scale grown on each
        # taken step and backed off on each skipped one. What it protects: exactly the overflowing
        # iterations were skipped. Here: the steps taken and skipped, and that scales other than 1 were used.
        if enabled:
            assert (len(steps), scaler.skipped_steps) == (unskipped, skipped)
            assert any(scale != 1.0 for scale in overflow.scales)
        else:
            assert (len(steps), scaler.skipped_steps, scaler.get_scale()) == (unskipped + skipped, 0, 1.0)
        assert_same_training(mod_control, mod_scaling, opt_control, opt_scaling)


# --- unscale_ and the finiteness check -------------------------------------------------------------


def test_grad_scaling_unscale_kernel_cases() -> None:
    """test_grad_scaling_unscale, first half: upstream's table of contiguous, transposed and sliced
    gradient pairs through the fused check GradientScaler uses (``unscale_and_check_``), mixed dtypes too."""
    g = torch.full((20, 20), 4.0)
    ginf, gnan = g.clone(), g.clone()
    ginf[2, 2], gnan[2, 2] = float("inf"), float("nan")
    cases = (
        ([g.clone(), g.clone()], False),
        ([g.clone(), g.clone().t()], False),
        ([g.clone(), g.clone()[:, :5]], False),
        ([g.clone()[:, :5], g.clone()[:, :5]], False),
        ([g.clone(), g.to(torch.float16)], False),
        ([g.clone(), ginf.clone()], True),
        ([g.clone(), gnan.clone()], True),
        ([g.clone(), ginf.clone()[:, :5]], True),
        ([g.clone(), gnan.clone()[:, :5]], True),
        ([ginf.clone(), g.clone()[:, :5]], True),
        ([ginf.clone()[:, :5], g.clone()[:, :5]], True),
    )
    for grads, has_inf in cases:
        (found_inf,) = unscale_and_check_(grads, 0.25)
        assert found_inf.item() == float(has_inf)
        if not has_inf:
            assert all(torch.equal(grad, torch.ones_like(grad)) for grad in grads)


@pytest.mark.parametrize("inject_inf", range(-1, 4))
def test_grad_scaling_unscale_perfect_storm(inject_inf: int) -> None:
    """test_grad_scaling_unscale, second half: gradients of mixed dtypes and layouts written into
    ``.grad`` by hand, an inf in any one of them (``inject_inf``; -1: none).

    Upstream calls ``GradScaler._unscale_grads_`` and checks the per-device found-inf flags and that the
    gradients were divided by the scale. Here ``.grad`` already holds true gradients: ``unscale_`` must
    leave them as they are, and ``step`` must skip exactly when an inf was injected."""
    g = torch.full((20, 20), 4.0)
    grads = [g.clone(), g.clone()[:, :5], g.to(torch.float16), g.to(torch.float16)]
    if inject_inf >= 0:
        grads[inject_inf][2, 2] = float("inf")
    params = [nn.Parameter(torch.zeros_like(grad)) for grad in grads]
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer = torch.optim.SGD(params, lr=1.0)
    scaler = GradientScaler()
    written = [grad.clone() for grad in grads]
    scaler.unscale_(optimizer)
    assert all(torch.equal(p.grad, w) for p, w in zip(params, written))
    assert scaler.step(optimizer) == (inject_inf < 0)
    stepped = [torch.full_like(grad, -4.0) for grad in grads]
    assert all(torch.equal(p, s if inject_inf < 0 else torch.zeros_like(s)) for p, s in zip(params, stepped))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grad_scaling_unscale_sparse(dtype: torch.dtype) -> None:
    """Sparse gradients written into ``.grad``: finite ones are stepped on as they are (upstream: divided
    by the scale), an inf or NaN among their values skips the step (upstream: found_inf is 1)."""
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    param = nn.Parameter(torch.zeros(2, 3, dtype=dtype))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = GradientScaler()
    for last, finite in ((64.0, True), (float("inf"), False), (float("nan"), False)):
        grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, last]), (2, 3), dtype=dtype, check_invariants=True)
        before = param.detach().clone()
        param.grad = grad.clone()
        scaler.unscale_(optimizer)
        torch.testing.assert_close(param.grad.to_dense(), grad.to_dense(), rtol=0, atol=0, equal_nan=True)
        assert scaler.step(optimizer) == finite
        assert torch.equal(param.detach(), before - grad.to_dense() if finite else before)
        scaler.update()


def test_grad_scaling_unscale_sparse_uncoalesced_fp16_overflow() -> None:
    """test_grad_scaling_unscale_sparse, its last case: an uncoalesced fp16 sparse gradient whose
    duplicate entries are finite but overflow once summed (64000 + 64000 > fp16's max) must be reported,
    since the optimizer coalesces it: the step is skipped and the weights stay finite."""
    param = nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = GradientScaler()
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    param.grad = torch.sparse_coo_tensor(
        i, torch.tensor([64000.0, 32.0, 64000.0]), (2, 3), dtype=torch.float16, check_invariants=True
    )
    assert not scaler.step(optimizer)
    assert torch.equal(param.detach(), torch.zeros_like(param))


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
def test_step_without_a_backward_raises_as_gradscaler_does(unscale_first: bool) -> None:
    """A step whose optimizer holds no gradient, the backward forgotten after ``zero_grad``: upstream's
    ``GradScaler.step`` raises ``AssertionError("No inf checks were recorded for this optimizer.")``
    (test_grad_scaling_* reach it through their loops; here it is called on its own, beside GradScaler).
    GradientScaler raises the same, saying what is missing, and leaves the weights alone; a backward
    afterwards makes the optimizer's next step a normal one."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for make in (lambda model: torch.amp.GradScaler("cpu"), GradientScaler):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scaler = make(model)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()  # and no backward
        before = [p.detach().clone() for p in model.parameters()]
        if unscale_first:
            scaler.unscale_(optimizer)  # nothing to check: it is the step that raises
        with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
            scaler.step(optimizer)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(AssertionError, match=r"none of its parameters has a gradient.*before step\(\)"):
        scaler.step(optimizer)
    scaler.scale(F.mse_loss(model(x), y)).backward()
    assert scaler.step(optimizer) and not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_grad_scaling_update_scale() -> None:
    """GradScaler's ``_amp_update_scale_`` backs its scale off after an overflow and grows it after
    ``growth_interval`` clean iterations. GradientScaler's counterpart: a skipped step caps the
    accumulated scales below those that overflowed and makes the next backward decide new scales; a
    clean interval afterwards relaxes the cap."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model, update_interval=2)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def iteration(overflow: bool) -> bool:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss * float("inf") if overflow else loss).backward()
        stepped = scaler.step(optimizer)
        scaler.update()
        return stepped

    assert iteration(False) and iteration(False)
    assert scaler.state_dict()["backoff"] is None
    assert not iteration(True)
    state = scaler.state_dict()
    assert state["graphs"][-1]["update_reasons"] == ["SKIPPED_STEP"] and state["backoff"] is not None
    capped = state["backoff"]
    assert iteration(False)  # decides new scales under the cap
    assert scaler.state_dict()["graphs"][-1]["update_reasons"] == []
    assert max(layer.log2_total for layer in scaler.layers()) <= capped
    for _ in range(4):  # two clean intervals
        assert iteration(False)
    backoff = scaler.state_dict()["backoff"]
    assert backoff is None or backoff > capped


def test_grad_scale_will_not_overflow() -> None:
    """Upstream starts GradScaler at 1e38 with growth 16 and checks the scale stays finite. The property:
    tiny gradients (targets of 1e-30) do not drive the scales to inf; the step is taken, weights finite."""
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = GradientScaler(model)
    x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    assert scaler.step(optimizer)
    scaler.update()
    assert all(torch.isfinite(torch.tensor(scale)) for scale in scaler.scales().values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --- scale, state_dict, the optimizer interface -----------------------------------------------------


def test_grad_scaling_scale() -> None:
    """Tensors in nested tuples and lists are scaled, and come back in the same structure.

    Upstream checks each value is 4 × 2 (its init_scale) and that the lazily made scale tensor sits on
    the outputs' device; GradientScaler has no such tensor, and its ``get_scale()`` is 1, so the values
    come back as they went in. What the scaling is for: a backward through the scaled outputs leaves
    true gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    reference = copy.deepcopy(model)
    scaler = GradientScaler(model)
    x = torch.randn(4, 8)
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 4.0)
    outputs = scaler.scale((t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())]))
    assert isinstance(outputs, tuple) and isinstance(outputs[1], tuple) and isinstance(outputs[2], list)
    assert all(t == 4.0 * scaler.get_scale() for t in (outputs[0], *outputs[1], outputs[2][0], *outputs[2][1]))

    def losses(net: nn.Module) -> list:
        h = net(x)
        return [h.pow(2).mean(), (h.sum() * 1e-3, h.abs().mean())]

    scaled = scaler.scale(losses(model))
    torch.autograd.backward([scaled[0], *scaled[1]])
    expected = losses(reference)
    torch.autograd.backward([expected[0], *expected[1]])
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("lazy_init", [True, False], ids=["after_a_backward", "fresh"])
def test_grad_scaling_state_dict(lazy_init: bool) -> None:
    """s1.load_state_dict(s0.state_dict()) makes s1 continue as s0, whether s1 has run a backward or not.

    Upstream builds s0 and s1 with different settings (init scale, growth and backoff factors, growth
    interval) and checks that s1 has s0's after the load: GradScaler's settings travel with its state.
    Here the settings are the recipe: s1, built with another preset and other fields, takes s0's, with
    one warning naming each field that changed; its state (upstream: the scale and
    ``_init_growth_tracker``) is s0's counters and scales, its own earlier progress overwritten."""
    torch.manual_seed(0)
    model0 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model1 = copy.deepcopy(model0)
    s0 = GradientScaler(model0, update_interval=2, backoff_bits=3, underflow_rate=1e-4)
    s1 = GradientScaler(model1, "paper", update_interval=5)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for overflow in (False, True, False):
        loss = F.mse_loss(model0(x), y)
        s0.scale(loss * float("inf") if overflow else loss).backward()
        s0.update()
    if lazy_init:
        s1.scale(F.mse_loss(model1(x * 1e-3), y)).backward()
    built_with = s1.recipe
    with pytest.warns(RuntimeWarning) as warned:
        s1.load_state_dict(s0.state_dict())
    assert len(warned) == 1
    for field in built_with.differences(s0.recipe):
        assert f"{field}={getattr(s0.recipe, field)!r} (built with {getattr(built_with, field)!r})" in str(
            warned[0].message
        )
    assert s1.recipe == s0.recipe
    assert (s1.recipe.update_interval, s1.recipe.backoff_bits, s1.recipe.underflow_rate) == (2, 3, 1e-4)
    assert s1.state_dict() == s0.state_dict()
    assert (s1.iteration, s1.skipped_steps, s1.scales()) == (s0.iteration, s0.skipped_steps, s0.scales())
    for model, scaler in ((model0, s0), (model1, s1)):
        model.zero_grad(set_to_none=True)
        scaler.scale(F.mse_loss(model(x), y)).backward()
    assert s1.state_dict() == s0.state_dict()
    for p, q in zip(model0.parameters(), model1.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def test_grad_scaler_pass_itself() -> None:
    """Optimizers that unscale in their own step (``_step_supports_amp_scaling``) get GradScaler itself
    (``grad_scaler=``) or its ``grad_scale`` and ``found_inf`` attributes. With GradientScaler ``.grad`` is
    already true: such an optimizer must get neither, or it would unscale a second time."""
    seen = []

    class AmpAwareOptimizer(torch.optim.Optimizer):
        def __init__(self, params) -> None:
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

        def step(self, closure=None, *, grad_scaler=None):
            seen.append((grad_scaler, getattr(self, "grad_scale", None), getattr(self, "found_inf", None)))

    model = nn.Linear(4, 1)
    scaler = GradientScaler(model)
    optimizer = AmpAwareOptimizer(model.parameters())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 4)).float().mean()
    scaler.scale(loss).backward()
    assert scaler.step(optimizer)
    scaler.update()
    assert seen == [(None, None, None)]


# --- training loops: a scaling run against a control run ---------------------------------------------


def autocast_run(pickle_scaler: bool) -> Callable:
    """Upstream ``_grad_scaling_autocast_test``'s loop (``try_pickle``: the scaler goes through pickle
    after every iteration, and the loop carries on with the copy).

    Upstream's control runs in fp32 and is compared at atol=1e-3, a margin Adam and AdamW are expected
    to miss; here the control runs the same fp16 autocast without a scaler, so the comparison isolates
    the scaler, and is exact."""

    def run(data, model, optimizer, scaler, loss_fn, overflow, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                output = model(input)
                if try_scaling_api:
                    overflow.in_backward(output, i, scaler)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                overflow.written(model, i, scaler)
                scaler.step(optimizer)
                scaler.update()
                if pickle_scaler:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if not scaler.is_enabled() or i != SKIP_ITER:
                    optimizer.step()
        return scaler

    return run


AUTOCAST_OPTIMIZERS = {
    f"{ctor.__name__}{'_' + impl if impl else ''}": (ctor, {impl: True} if impl else {})
    for ctor in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
    for impl in (None, "foreach", "fused")
}


@pytest.mark.parametrize("pickle_scaler", [False, True], ids=["", "pickled"])
@pytest.mark.parametrize("optimizer", list(AUTOCAST_OPTIMIZERS))
def test_grad_scaling_autocast(optimizer: str, pickle_scaler: bool) -> None:
    """test_grad_scaling_autocast (and its foreach and fused variants): fp16 autocast, one iteration's step skipped."""
    ctor, kwargs = AUTOCAST_OPTIMIZERS[optimizer]
    run_scaling_case(
        autocast_run(pickle_scaler),
        unskipped=3,
        skipped=1,
        source="written_grad",
        optimizer_ctor=ctor,
        optimizer_kwargs=kwargs,
    )


@pytest.mark.parametrize("source", OVERFLOW_SOURCES)
def test_grad_scaling_clipping(source: str) -> None:
    """Upstream clips the *scaled* gradients at ``max_norm * scaler.get_scale()`` without unscale_. With
    GradientScaler ``.grad`` is true and ``get_scale()`` is 1: the same line clips true gradients at max_norm."""

    def run(data, model, optimizer, scaler, loss_fn, overflow, try_scaling_api):
        max_norm = 0.2  # upstream's: a value that actually clips these gradients
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            if try_scaling_api:
                overflow.in_backward(output, i, scaler)
                scaler.scale(loss_fn(output, target)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                overflow.written(model, i, scaler)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss_fn(output, target).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != SKIP_ITER:
                    optimizer.step()

    run_scaling_case(run, unskipped=3, skipped=1, source=source)


@pytest.mark.parametrize("source", OVERFLOW_SOURCES)
def test_grad_scaling_clipping_separate_unscale(source: str) -> None:
    def run(data, model, optimizer, scaler, loss_fn, overflow, try_scaling_api):
        max_norm = 0.2
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            if try_scaling_api:
                overflow.in_backward(output, i, scaler)
                scaler.scale(loss_fn(output, target)).backward()
                overflow.written(model, i, scaler)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss_fn(output, target).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != SKIP_ITER:
                    optimizer.step()

    run_scaling_case(run, unskipped=3, skipped=1, source=source)


@pytest.mark.parametrize("source", OVERFLOW_SOURCES)
def test_grad_scaling_penalty(source: str) -> None:
    """The gradient-penalty recipe: ``torch.autograd.grad(scaler.scale(loss), params, create_graph=True)``
    times ``1 / get_scale()`` must be the true gradient, whose norm joins the loss."""

    def run(data, model, optimizer, scaler, loss_fn, overflow, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                overflow.in_backward(output, i, scaler)
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = sum(grad.pow(2).sum() for grad in grad_params).sqrt()
            loss = loss + grad_norm
            if try_scaling_api:
                scaler.scale(loss).backward()
                overflow.written(model, i, scaler)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != SKIP_ITER:
                    optimizer.step()

    run_scaling_case(run, unskipped=3, skipped=1, source=source)


def test_grad_scaling_accumulation() -> None:
    def run(data, model, optimizer, scaler, loss_fn, overflow, try_scaling_api):
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            loss = loss_fn(model(input), target) / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
                overflow.written(model, i, scaler)  # no overflow here: notes the scales
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_scaling_case(run, unskipped=2, skipped=0)


@pytest.mark.parametrize("source", OVERFLOW_SOURCES)
def test_grad_scaling_multiple(source: str) -> None:
    """Two models, two optimizers, both receiving gradients from two losses (the first backward with
    retain_graph); model1's gradients overflow at SKIP_ITER, so only optimizer1 skips. One scaler
    names both models' layers."""
    for enabled in (True, False):
        mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn = create_scaling_case()
        mod_control1, mod_scaling1, opt_control1, opt_scaling1 = create_scaling_models_optimizers()
        scaler = GradientScaler(nn.ModuleList([mod_scaling0, mod_scaling1]), update_interval=2, enabled=enabled)
        steps0, steps1 = count_steps(opt_scaling0), count_steps(opt_scaling1)
        overflow = Overflow(source)

        def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
            for i, (input, target) in enumerate(data):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                output0, output1 = model0(input), model1(input)
                if try_scaling_api:
                    overflow.in_backward(output1, i, scaler)
                loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
                loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    overflow.written(model1, i, scaler)
                    scaler.unscale_(optimizer0)  # upstream's extra stress: one optimizer unscaled separately
                    scaler.step(optimizer0)
                    scaler.step(optimizer1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()
                    if not scaler.is_enabled() or i != SKIP_ITER:
                        optimizer1.step()

        run(mod_control0, mod_control1, opt_control0, opt_control1, False)
        run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)
        # Upstream: the scale grew 3 times and backed off once. What it protects: which steps were skipped.
        assert (len(steps0), len(steps1), scaler.skipped_steps) == ((4, 3, 1) if enabled else (4, 4, 0))
        assert any(scale != 1.0 for scale in overflow.scales) == enabled
        for c, s in zip(
            chain(mod_control0.parameters(), mod_control1.parameters()),
            chain(mod_scaling0.parameters(), mod_scaling1.parameters()),
        ):
            torch.testing.assert_close(s, c, rtol=0, atol=0)


FUSED_OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {}),
    "Adam_amsgrad": (torch.optim.Adam, {"amsgrad": True}),
    "AdamW": (torch.optim.AdamW, {}),
    "AdamW_amsgrad": (torch.optim.AdamW, {"amsgrad": True}),
    "SGD_momentum": (torch.optim.SGD, {"momentum": 0.9}),
}


@pytest.mark.parametrize("separate_unscale", [False, True], ids=["", "separate_unscale"])
@pytest.mark.parametrize("optimizer", list(FUSED_OPTIMIZERS))
def test_grad_scaling_autocast_fused_optimizers(optimizer: str, separate_unscale: bool) -> None:
    """The fused optimizer against its for-loop version, each under its own scaler and fp16 autocast,
    compared after every iteration. A GradScaler hands fused optimizers its scale to unscale in their
    kernel; with GradientScaler both step on the true ``.grad`` as it is, and must agree."""
    ctor, kwargs = FUSED_OPTIMIZERS[optimizer]
    mod_control, mod_scaling, _, opt_scaling, data, loss_fn = create_scaling_case(ctor, {**kwargs, "fused": True})
    opt_control = ctor(mod_control.parameters(), lr=1.0, **kwargs, fused=False)
    scaler_control, scaler_scaling = (
        GradientScaler(mod_control, update_interval=2),
        GradientScaler(mod_scaling, update_interval=2),
    )
    # upstream's tolerances: fused and for-loop Adam round differently with float betas
    loose = {"atol": 2e-5, "rtol": 2e-5}
    for input, target in data:
        losses = []
        for model, opt, scaler, unscale in (
            (mod_control, opt_control, scaler_control, False),
            (mod_scaling, opt_scaling, scaler_scaling, separate_unscale),
        ):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                losses.append(loss_fn(model(input), target))
            scaler.scale(losses[-1]).backward()
            if unscale:
                scaler.unscale_(opt)
            assert scaler.step(opt)
            scaler.update()
        torch.testing.assert_close(losses[1], losses[0])
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            torch.testing.assert_close(s.grad, c.grad)
            torch.testing.assert_close(s, c, **loose)
            for k, expected in opt_control.state[c].items():
                actual = opt_scaling.state[s][k]
                torch.testing.assert_close(
                    actual.squeeze() if k == "step" else actual, expected, **(loose if "exp_avg_sq" in k else {})
                )


@pytest.mark.parametrize("impl", ["for_loop", "foreach", "fused"])
@pytest.mark.parametrize("ctor", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(ctor, impl: str) -> None:
    """GradScaler's rule: ``unscale_`` checks, and ``step`` steps on what ``.grad`` holds then, without a
    second check (nor, for fused optimizers, a second unscale). Gradients broken after unscale_ reach
    the weights, as with GradScaler."""
    kwargs = {"foreach": impl == "foreach", "fused": impl == "fused"}
    model, _, optimizer, _, data, loss_fn = create_scaling_case(ctor, kwargs)
    scaler = GradientScaler(model)
    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(input), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):  # deliberately break the gradients
            param.grad.copy_(torch.inf if j % 2 else torch.nan)
        scaler.step(optimizer)
        scaler.update()
    assert all(not torch.isfinite(p).all() for p in model.parameters())
