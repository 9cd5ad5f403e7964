"""The Fabric plugins with FSDP1 (raw ``FullyShardedDataParallel`` on 2 gloo CPU ranks) and DeepSpeed refused.

Fabric builds its FSDP strategy only on CUDA; torch's FSDP1 itself runs on CPU ranks when given
``device_id=torch.device("cpu")``, which is how the plugin's backward is checked here: with the
plugin's float32 policy the gradients of a loss 1e-5 times smaller (weight gradients of median
5e-8) match fp32; with ``FSDPPrecision("16-mixed")``'s float16 policy the plugin refuses to run, and
the same scaled backward flushes a large share of them.
"""

from __future__ import annotations

import copy
import os
import socket
from importlib import import_module
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gs_lightning.fabric import FSDPGradientScalingPlugin, GradientScalingPlugin

SHRINK = 1e-5  # the loss factor: weight gradients of median ~5e-8, under fp16's smallest normal (6.1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    reference = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 64, generator=g), torch.randint(0, 8, (8,), generator=g)
    # fp32, unsharded: FSDP averages the two ranks' mean losses.
    sum(nn.functional.cross_entropy(reference(x[r::2]), y[r::2]) for r in (0, 1)).mul(SHRINK / 2).backward()
    fp16_policy = import_module("lightning.fabric.plugins.precision").FSDPPrecision("16-mixed").mixed_precision_config
    results = {}
    for name, policy in (("plugin", FSDPGradientScalingPlugin().mixed_precision_config), ("float16", fp16_policy)):
        plugin = FSDPGradientScalingPlugin()
        model = FSDP(
            plugin.convert_module(copy.deepcopy(net)),
            mixed_precision=policy,
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        with plugin.forward_context():
            loss = nn.functional.cross_entropy(model(plugin.convert_input(x[rank::2])), y[rank::2]) * SHRINK
        try:
            plugin.backward(loss, model)
        except ValueError as error:
            results[f"{name} refused"] = str(error)
            plugin.scaler.scale(loss).backward()  # what it would have done
        with FSDP.summon_full_params(model, with_grads=True):
            weight, expected = model.module[0].weight.grad, reference[0].weight.grad
            results[name] = {
                "flushed": ((weight == 0) & (expected != 0)).float().mean().item(),
                "error": ((weight - expected).norm() / expected.norm()).item(),
            }
    results["median"] = reference[0].weight.grad.abs().median().item()
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")
    dist.barrier()  # neither rank tears gloo down while the other still uses it (a rank aborted in CI once)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp1_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fsdp1")
    mp.spawn(_rank, args=(_free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out / "results.pt")


def test_fsdp1_with_the_plugins_policy_keeps_small_gradients(fsdp1_results: dict) -> None:
    assert 1e-8 < fsdp1_results["median"] < 1e-7
    assert fsdp1_results["plugin"]["flushed"] == 0 and fsdp1_results["plugin"]["error"] < 2e-3
    assert "plugin refused" not in fsdp1_results


def test_fsdp1_with_a_float16_policy_is_refused_and_would_flush(fsdp1_results: dict) -> None:
    assert "reduces the gradients in float16" in fsdp1_results["float16 refused"]
    assert "\n" not in fsdp1_results["float16 refused"]
    assert fsdp1_results["float16"]["flushed"] > 0.1 and fsdp1_results["float16"]["error"] > 0.05


@pytest.mark.parametrize("package", ["lightning.fabric", "lightning_fabric"])
def test_fabric_fsdp_strategy_takes_the_fsdp_plugin(package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{package}.accelerators.cuda.num_cuda_devices", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fabric_module = import_module(package)
    strategy = import_module(f"{package}.strategies").FSDPStrategy()
    plugin = FSDPGradientScalingPlugin()
    fabric = fabric_module.Fabric(accelerator="gpu", devices=2, strategy=strategy, plugins=[plugin])
    assert fabric.strategy.precision is plugin
    assert fabric.strategy.mixed_precision_config.param_dtype == torch.float32
    with pytest.raises(TypeError, match="FSDPPrecision"):
        fabric_module.Fabric(
            accelerator="gpu",
            devices=2,
            strategy=import_module(f"{package}.strategies").FSDPStrategy(),
            plugins=[GradientScalingPlugin()],
        )


def test_a_deepspeed_engine_is_refused_in_backward() -> None:
    """Fabric hands the plugin's backward DeepSpeed's engine; known by class name, deepspeed not installed."""
    deepspeed_engine = type("DeepSpeedEngine", (nn.Module,), {})
    model = nn.Linear(4, 2)
    plugin = GradientScalingPlugin()
    plugin.convert_module(model)
    with plugin.forward_context():
        loss = model(torch.randn(3, 4)).sum()
    with pytest.raises(RuntimeError, match="cannot run under DeepSpeed"):
        plugin.backward(loss, deepspeed_engine())
    assert model.weight.grad is None  # refused before any backward
