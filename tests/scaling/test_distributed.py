"""GradientScaler under DistributedDataParallel: 2 gloo processes on the CPU against one process on the global batch.

DDP all-reduces gradients during the backward, so no gradient waits for the fused unscale after it;
the drift statistic reads them at the step instead, all-reduced. Each rank reads them by its own
scale groups (its scales come from its own shard of the batch, and need not agree with the other
ranks': the all-reduce sums true gradients), and the drift-triggered updates follow as in one process.
"""

from __future__ import annotations

import gc
import math
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gs_lightning
from gs_lightning import GradientScaler

STEPS, WORLD = 30, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(64, 32, generator=generator), torch.randn(64, 16, generator=generator)


def _train(model: nn.Module, x: torch.Tensor, upstream: torch.Tensor, scaler: GradientScaler) -> dict[str, object]:
    """STEPS fp16-autocast steps of a loss whose gradients shrink 2^8 (lr 0: only the loss changes)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    updates, drifts = [], []
    for t in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x).float() * upstream).mean() * 2.0 ** (-8 * t / (STEPS - 1))
        optimizer.zero_grad(set_to_none=True)
        before = scaler.update_iterations
        scaler.backward(loss)
        assert scaler.step(optimizer)
        scaler.update()
        drifts.append(scaler.drift.drift_log2)
        if scaler.update_iterations > before:
            updates.append(t)
    return {"updates": updates, "drifts": drifts, "measured": len(scaler.drift.measured)}


def _ddp_steps(rank: int, out: Path) -> None:
    model = DistributedDataParallel(_model())
    x, upstream = _batch()
    half = slice(rank * 32, (rank + 1) * 32)  # the mean over each half, averaged by DDP: the global batch's mean
    torch.save(
        _train(model, x[half], upstream[half], GradientScaler(model, update_interval=100)), out / f"rank{rank}.pt"
    )


def _rank(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        _ddp_steps(rank, out)
        gc.collect()  # as in _inf_rank: DDP's and FSDP's reference cycles go before the process group does
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_measures_drift_and_updates_where_one_process_does(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(_free_port(), tmp_path), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    model = _model()
    single = _train(model, *_batch(), GradientScaler(model, update_interval=100))
    # the drift asked for updates between the scheduled ones
    assert single["measured"] == 4 and len(single["updates"]) > 1
    for result in ranks:
        assert result["measured"] == 4  # every weight gradient read, though none was deferred
        assert result["updates"] == single["updates"]
        assert all(math.isfinite(d) for d in result["drifts"])  # read on every step (NaN: nothing was measured)


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    block = lambda n_in, n_out: nn.Sequential(nn.Linear(n_in, n_out), nn.BatchNorm1d(n_out), nn.ReLU())  # noqa: E731
    return nn.Sequential(block(16, 32), block(32, 32), nn.Linear(32, 4))


def _bn_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, list[str], list[list[str]]]:
    """4 fp16-autocast SGD steps under GradientScaler (update_interval=2: updates and replays); the skipped
    steps, the kinds of the decisions and the layers' names after each step."""
    scaler, optimizer = GradientScaler(model, update_interval=2), torch.optim.SGD(model.parameters(), lr=0.1)
    names = []
    for _ in range(4):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        scaler.backward(loss)
        scaler.step(optimizer)
        scaler.update()
        names.append(sorted(layer.name for layer in scaler.layers()))
    return scaler.skipped_steps, sorted(layer.kind for layer in scaler.layers()), names


def _fsdp2_rank(rank: int, port: int, out: Path) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model = _bn_model()
        for block in list(model)[:2]:
            # resharded after the forward: the BatchNorm weights' storage is freed until the backward
            fully_shard(block)
        fully_shard(model)
        x, y = torch.randn(16, 16, generator=torch.Generator().manual_seed(rank)), torch.arange(16) % 4
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = _bn_steps(model, x, y)
        fp16 = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        fully_shard(fp16, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
        with pytest.raises(ValueError) as refused:  # its unsharded parameters are fp16
            GradientScaler(fp16).backward(fp16(torch.randn(2, 4)).float().sum())
        found = [(str(w.message), w.filename) for w in caught]
        torch.save({"steps": steps, "warnings": found, "refused": str(refused.value)}, out / f"fsdp{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_with_batch_norm_in_resharded_blocks_trains_and_skips_what_the_unsharded_model_does(
    tmp_path: Path,
) -> None:
    """The update's BatchNorm gain bound reads no weight FSDP2 freed (it crashed the process with SIGSEGV), and
    FSDP2's autograd markers pass the scales through: the same decisions as unsharded, no opaque region. The
    layers carry their modules' names from the first step, though the autograd graph holds FSDP2's unsharded
    parameters, not the sharded ones (DTensors) the modules hold outside the forward; no warning comes of our
    code, nor of a DTensor it made."""
    mp.spawn(_fsdp2_rank, args=(_free_port(), tmp_path), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"fsdp{r}.pt") for r in range(WORLD)]
    unsharded = _bn_steps(
        _bn_model(), torch.randn(16, 16, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 4
    )
    assert unsharded == (0, ["cast", "gemm", "gemm", "gemm"], [["0.0", "1.0", "2", "2.cast"]] * 4)
    assert [rank["steps"] for rank in ranks] == [unsharded] * WORLD
    package = str(Path(gs_lightning.__file__).parent)
    for rank in ranks:
        assert [(m, f) for m, f in rank["warnings"] if f.startswith(package) or "DTensor" in m] == []
        # named, not "of shape (2,)"
        assert rank["refused"].startswith("GradientScaler: parameter 2.bias is torch.float16")


def test_ddp_with_an_fp16_compression_hook_is_refused_in_one_line(tmp_path: Path) -> None:
    """True gradients all-reduced in fp16 flush below 6e-8; bf16 compression keeps fp32's range and is accepted."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for hook, refused in ((default_hooks.fp16_compress_hook, True), (default_hooks.bf16_compress_hook, False)):
            model = DistributedDataParallel(_model())
            model.register_comm_hook(None, hook)
            scaler = GradientScaler(model)
            x, upstream = _batch()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (model(x).float() * upstream).mean()
            if refused:
                with pytest.raises(
                    ValueError, match=r"fp16_compress_hook all-reduces gradients in fp16.*bf16_compress_hook"
                ):
                    scaler.backward(loss)
            else:
                scaler.backward(loss)
                assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy_process_group()


class _InfIntoTheLastEntry(torch.autograd.Function):
    """Identity forward; its backward adds inf to the gradient's last entry (on the rank that uses it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad + torch.tensor([0.0] * (grad.shape[-1] - 1) + [float("inf")], dtype=grad.dtype)


class _LinearWithInfBiasGradient(nn.Linear):
    """On rank 0, the bias gradient's last entry is inf, and nothing else: it lands in one rank's shard."""

    def __init__(self, n_in: int, n_out: int, rank: int) -> None:
        super().__init__(n_in, n_out)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = _InfIntoTheLastEntry.apply(self.bias) if self.rank == 0 else self.bias
        return nn.functional.linear(x, self.weight, bias)


def _inf_step(rank: int, out: Path, sharding: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), _LinearWithInfBiasGradient(16, 4, rank))
    if sharding == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(net, device_id=torch.device("cpu"))
    else:  # FSDP2: each Linear a unit, then the root; the gradients are DTensors, each rank holding its shard
        from torch.distributed.fsdp import fully_shard

        for layer in (net[0], net[2]):
            fully_shard(layer)
        model = fully_shard(net)
    scaler, optimizer = GradientScaler(model), torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().square().mean()
    scaler.backward(loss)
    scaler.step(optimizer)
    torch.save(scaler.skipped_steps, out / f"{sharding}_{rank}.pt")


def _inf_rank(rank: int, port: int, out: Path, sharding: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        _inf_step(rank, out, sharding)
        # DDP's and FSDP's modules hold reference cycles: collected now, not as the interpreter exits after the
        # process group is gone, where gloo aborted 1 exit in 6-20 ("terminate called without an active exception").
        gc.collect()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["fsdp1", "fsdp2"])
def test_an_inf_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path: Path, sharding: str) -> None:
    """FSDP reduce-scatters each gradient, so rank 0's inf in the last bias entry lands in one rank's shard
    only: the flag is reduced across ranks (the other rank would have stepped its half of the model)."""
    mp.spawn(_inf_rank, args=(_free_port(), tmp_path, sharding), nprocs=WORLD, join=True)
    assert [torch.load(tmp_path / f"{sharding}_{r}.pt") for r in range(WORLD)] == [1, 1]
