"""The Trainer plugins under Lightning's sharding strategies, and DeepSpeed refused.

* ``FSDPStrategy`` (FSDP1) takes only an ``FSDPPrecision``: the ``FSDP...`` plugins are, in both
  packages, with FSDP given float32 parameters and reductions. Lightning builds that strategy only
  for CUDA, so here the Trainer is built with two mocked CUDA devices (as Lightning's own tests do)
  and not fitted; FSDP1 itself trains on the CPU in ``tests/fabric/test_fabric_strategies.py``, and
  ``bench/gpu_check.sh`` fits the Trainer on a GPU.
* ``ModelParallelStrategy`` (FSDP2's ``fully_shard`` in ``configure_model``) trains two gloo ranks on
  the CPU with :class:`~gs_lightning.GradientScalingPlugin`: both ranks end with the same weights,
  those of one process that sees the whole global batch, and an inf on one rank skips the step on both.
* DeepSpeed runs the backward and keeps a loss scale of its own: refused when the strategy sets up.

Run as a script (``PYTHONPATH=tests python tests/lightning/test_strategies.py OUT_DIR``) this file is
the training program of the ModelParallelStrategy test: Lightning launches rank 1 by running it again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import import_module
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import DATA, Classifier, make_trainer
from lightning_packages import on_package
from torch.utils.data import DataLoader, TensorDataset

from gs_lightning import GradientScalingPlugin
from gs_lightning.lightning import FSDPDynamicLossScalingPlugin, FSDPGradientScalingPlugin

GLOBAL_BATCH = 8
STEPS = len(DATA) // GLOBAL_BATCH
PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def two_mocked_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's accelerator connector sees two CUDA devices (nothing runs on them)."""
    for module in (
        "lightning.fabric.accelerators.cuda",
        "lightning.pytorch.accelerators.cuda",
        "lightning_fabric.accelerators.cuda",
        "pytorch_lightning.accelerators.cuda",
    ):
        monkeypatch.setattr(f"{module}.num_cuda_devices", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("plugin_class", [FSDPGradientScalingPlugin, FSDPDynamicLossScalingPlugin])
def test_fsdp_strategy_takes_the_fsdp_plugins(
    package: str, plugin_class: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    two_mocked_gpus(monkeypatch)
    strategy = import_module(f"{package}.strategies").FSDPStrategy()
    plugin = plugin_class()
    trainer = import_module(package).Trainer(
        accelerator="gpu", devices=2, strategy=strategy, plugins=[plugin], logger=False
    )
    assert trainer.strategy is strategy and trainer.precision_plugin is plugin
    policy = strategy.mixed_precision_config  # what FSDP is given
    assert (policy.param_dtype, policy.reduce_dtype, policy.buffer_dtype) == (torch.float32,) * 3


@pytest.mark.parametrize("package", PACKAGES)
def test_fsdp_strategy_refuses_the_plain_plugin(package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the FSDP plugins exist: Lightning's check, which they pass."""
    two_mocked_gpus(monkeypatch)
    strategy = import_module(f"{package}.strategies").FSDPStrategy()
    with pytest.raises(TypeError, match="FSDPPrecision"):
        import_module(package).Trainer(
            accelerator="gpu", devices=2, strategy=strategy, plugins=[GradientScalingPlugin()]
        )


def test_fsdp_plugin_keeps_fsdp_precision_semantics() -> None:
    plugin = FSDPGradientScalingPlugin()
    for package in PACKAGES:
        assert isinstance(plugin, import_module(f"{package}.plugins.precision").FSDPPrecision)
    module = torch.nn.Linear(4, 4)
    assert plugin.convert_module(module) is module and module.weight.dtype == torch.float32  # no module.half()
    with plugin.module_init_context():
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32
    assert plugin.convert_input(torch.ones(2, dtype=torch.float16)).dtype == torch.float32
    assert plugin.precision == "16-mixed"
    # FSDP1 shards each parameter: a norm over the local shards is not the gradient's norm.
    with pytest.raises(import_module("lightning.pytorch.utilities.exceptions").MisconfigurationException, match="norm"):
        plugin.clip_grad_by_norm(None, 1.0)


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("plugin_class", [GradientScalingPlugin, FSDPGradientScalingPlugin])
def test_deepspeed_is_refused_at_setup(package: str, plugin_class: type) -> None:
    # DeepSpeedStrategy() itself needs deepspeed installed; the class is Lightning's, importable without it.
    deepspeed = object.__new__(import_module(f"{package}.strategies").DeepSpeedStrategy)
    model = on_package(Classifier, package)()
    model._trainer = SimpleNamespace(strategy=deepspeed)  # what DeepSpeedStrategy.setup hands convert_module
    with pytest.raises(RuntimeError, match="cannot run under DeepSpeed") as error:
        plugin_class().convert_module(model)
    assert "\n" not in str(error.value)


def test_other_strategies_pass_convert_module() -> None:
    model = Classifier()
    trainer = make_trainer(GradientScalingPlugin(), max_steps=1)
    model._trainer = trainer
    assert trainer.precision_plugin.convert_module(model) is model


class ShardedClassifier(Classifier):
    """Three Linear layers, each its own FSDP2 unit in ``configure_model``; saves its weights and scaler counters when
    training ends."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(hidden_layers=1)
        self.out_dir = out_dir

    def configure_model(self) -> None:
        if self.device_mesh is None:  # one process: nothing to shard
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)  # the root: the module training_step calls

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        # Rank r takes samples r, r + world, ...: each global batch is the single process's batch, in order.
        world, rank = self.trainer.world_size, self.global_rank
        x, y = DATA.tensors
        return DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=GLOBAL_BATCH // world)

    def on_train_end(self) -> None:
        scaler = self.trainer.precision_plugin.scaler
        # DTensor shards, gathered
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.parameters()]
        result = {
            "params": [p.detach().clone() for p in params],
            "skipped_steps": scaler.skipped_steps,
            "iteration": scaler.iteration,
        }
        torch.save(result, Path(self.out_dir) / f"rank{self.global_rank}.pt")


def train(out_dir: Path, devices: int) -> None:
    """Fit from the same initial weights on the same global batches of 8, sharded over ``devices`` ranks."""
    torch.manual_seed(0)
    model = ShardedClassifier(str(out_dir))
    # All data-parallel: the default sizes make a (1 x devices) mesh whose data-parallel dimension shards nothing.
    strategies = import_module("lightning.pytorch.strategies")
    strategy = (
        strategies.ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1) if devices > 1 else "auto"
    )
    trainer = import_module("lightning.pytorch").Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        plugins=[GradientScalingPlugin(update_interval=2)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)


def initial_params() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [p.detach() for p in ShardedClassifier("").parameters()]


def test_model_parallel_strategy_trains_two_ranks_on_the_cpu(tmp_path: Path) -> None:
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir(), sharded.mkdir()
    train(single, devices=1)
    # ModelParallelStrategy launches rank 1 by rerunning the command line: that must be this script, not pytest.
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, __file__, str(sharded)], check=True, timeout=180, cwd=tmp_path, env=env)
    rank0, rank1, reference = (
        torch.load(path) for path in (sharded / "rank0.pt", sharded / "rank1.pt", single / "rank0.pt")
    )
    for result in (rank0, rank1):
        assert result["iteration"] == STEPS  # every step ran a scaled backward
        assert len(result["params"]) == len(reference["params"])
        assert all(torch.isfinite(p).all() for p in result["params"])
        assert any(not torch.equal(p, q) for p, q in zip(result["params"], initial_params()))  # it trained
    assert all(torch.equal(p, q) for p, q in zip(rank0["params"], rank1["params"]))  # the gathered shards agree
    # the same global batches as one process, each rank's fp16 forward on half of them: weights within 1e-4
    # (measured: at most 2e-5 apart, on weights up to 0.36), nothing skipped
    assert all(torch.allclose(p, q, rtol=0, atol=1e-4) for p, q in zip(rank0["params"], reference["params"]))
    assert rank0["skipped_steps"] == reference["skipped_steps"] == 0


if __name__ == "__main__":
    train(Path(sys.argv[1]), devices=2)
