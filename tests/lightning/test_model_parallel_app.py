"""FSDP2 in the app: ``python train.py trainer=model_parallel`` shards each task's network in configure_model.

The demo recipe runs through ``train.py`` on two CPU ranks (gloo) with ``precision=gs``: every block of
SegNet is sharded over both ranks, every step's loss is finite, no step is skipped, the weights change,
and ``last.ckpt`` is one file that loads into the unsharded task. The blocks chosen for each recipe's
network, the no-op under other strategies and the refusal of a tensor-parallel mesh are checked in-process.
:class:`ShardProbe` is the callback the run is given (``+callbacks.probe=...``, this file on PYTHONPATH).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy

from gs_lightning.app import build, register_recipes, run
from gs_lightning.models import SegNetBasic
from gs_lightning.models.resnet import build_resnet
from gs_lightning.models.ssd import build_ssd
from gs_lightning.tasks import ClassificationTask, SegmentationTask
from gs_lightning.tasks.sharding import shard_units

ROOT = Path(__file__).resolve().parents[2]
register_recipes(ROOT / "recipes")
STEPS = 2
# The demo made tiny: 8 training images in batches of 2 per rank, so one epoch is 2 steps of a global batch of 4.
DEMO = [
    "data.root=${paths.cache_dir}/camvid",
    "++data.synthetic={n_train: 8, n_val: 2, n_test: 2, size: [24, 32], seed: 0}",
    "data.batch_size=2",
    "data.num_workers=0",
    "model.width=4",
]


class ShardProbe(L.Callback):
    """Writes ``<out_dir>/rank<r>.json``: the FSDP2 units of the task's network and how each parameter is
    sharded (as fitting starts: the sanity check's forward leaves the root unit gathered), every step's
    loss, and the scaler's skipped steps (when training ends)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.record: dict[str, Any] = {"losses": []}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        model = pl_module.model
        self.record["units"] = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
        self.record["params"] = {
            name: {
                "dtensor": isinstance(p, DTensor),
                "ranks": p.device_mesh.size() if isinstance(p, DTensor) else 1,
                "local": p.to_local().numel() if isinstance(p, DTensor) else p.numel(),
                "global": p.numel(),
                "dtype": str(p.dtype),
            }
            for name, p in model.named_parameters()
        }

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.record["losses"].append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["skipped_steps"] = trainer.precision_plugin.scaler.skipped_steps
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))


def _initial_demo_task(tmp_path: Path) -> L.LightningModule:
    """The demo's task as ``train.py`` builds it, before training (same seed, same order of construction)."""
    overrides = [
        "recipe=demo",
        f"paths.cache_dir={tmp_path / 'cache'}",
        f"paths.output_dir={tmp_path / 'unsharded'}",
        "trainer.accelerator=cpu",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return build(compose(config_name="config", overrides=[*overrides, *DEMO])).task


def test_train_py_shards_the_demo_over_two_cpu_ranks_and_trains(tmp_path: Path) -> None:
    probes = tmp_path / "probes"
    probes.mkdir()
    run_dir = tmp_path / "run"
    args = [
        f"hydra.run.dir={run_dir}",
        "trainer=model_parallel",
        "trainer.accelerator=cpu",
        "precision=gs",
        *DEMO,
        f"trainer.max_steps={STEPS}",
        "trainer.check_val_every_n_epoch=1",
        "++trainer.enable_progress_bar=false",
        "++trainer.enable_model_summary=false",
        f"+callbacks.probe={{_target_: test_model_parallel_app.ShardProbe, out_dir: '{probes}'}}",
    ]
    # Lightning launches rank 1 by running the same command again, with the run directory Hydra chose.
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "GS_CACHE_DIR": str(tmp_path / "cache"),
        "GS_DATA_DIR": str(tmp_path / "data"),
    }
    result = subprocess.run(
        [sys.executable, "train.py", *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    ranks = [json.loads((probes / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in ranks:
        assert record["units"] == [
            "",  # the root: the classifier, and what the blocks leave
            *(f"encoders.{i}" for i in range(4)),
            *(f"decoders.{i}" for i in range(4)),
        ]
        for name, param in record["params"].items():
            assert param["dtensor"] and param["ranks"] == 2 and param["dtype"] == "torch.float32", name
        assert len(record["losses"]) == STEPS and all(math.isfinite(loss) for loss in record["losses"])
        assert record["skipped_steps"] == 0
    for name, param in ranks[0]["params"].items():  # every parameter split over both ranks
        assert 0 < param["local"] < param["global"] == param["local"] + ranks[1]["params"][name]["local"], name
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own half of the batch

    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == STEPS and results["skipped_steps"] == 0
    assert math.isfinite(results["metrics"]["train/loss"]) and "test/miou" in results["metrics"]

    # last.ckpt is one file whose weights load into the unsharded task, and they moved from the initial ones.
    task = _initial_demo_task(tmp_path)
    initial = {name: tensor.clone() for name, tensor in task.state_dict().items()}
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == STEPS
    task.load_state_dict(checkpoint["state_dict"])
    for name, _ in task.named_parameters():
        assert torch.isfinite(checkpoint["state_dict"][name]).all() and not torch.equal(
            checkpoint["state_dict"][name], initial[name]
        ), name


@pytest.mark.parametrize(
    ("model", "units"),
    [
        (lambda: build_resnet("resnet18", num_classes=4), ["layer1", "layer2", "layer3", "layer4"]),
        (
            lambda: SegNetBasic(num_classes=11, width=4),
            [f"encoders.{i}" for i in range(4)] + [f"decoders.{i}" for i in range(4)],
        ),
        (lambda: build_ssd(size=300, num_classes=21, pretrained=False, width_mult=0.03125), ["backbone", "head"]),
    ],
    ids=["resnet18", "segnet", "ssd300"],
)
def test_each_recipes_network_is_sharded_by_its_blocks(model: Any, units: list[str]) -> None:
    """Residual stages, encoder/decoder stages, backbone and head; lone layers (stem, fc, classifier) stay with the
    root."""
    network = model()
    names = {module: name for name, module in network.named_modules()}
    assert [names[unit] for unit in shard_units(network)] == units


def _attach(task: L.LightningModule, strategy: Any, mesh: Any = None) -> None:
    task._trainer = SimpleNamespace(strategy=strategy)
    task._device_mesh = mesh


def test_configure_model_does_nothing_under_other_strategies() -> None:
    task = SegmentationTask(SegNetBasic(num_classes=11, width=4))
    before = {
        name: (type(module), module.weight) for name, module in task.model.named_modules() if hasattr(module, "weight")
    }
    _attach(task, SingleDeviceStrategy(device=torch.device("cpu")))
    task.configure_model()
    assert {
        name: (type(module), module.weight) for name, module in task.model.named_modules() if hasattr(module, "weight")
    } == before


def test_a_tensor_parallel_mesh_is_refused_with_the_settings_to_change() -> None:
    task = ClassificationTask(build_resnet("resnet18", num_classes=4), num_classes=4)
    mesh = {"data_parallel": SimpleNamespace(size=lambda: 1), "tensor_parallel": SimpleNamespace(size=lambda: 2)}
    _attach(task, ModelParallelStrategy(), mesh)
    with pytest.raises(
        ValueError, match="data_parallel=1 x tensor_parallel=2; set trainer.strategy.data_parallel_size"
    ):
        task.configure_model()


def test_the_app_refuses_a_tensor_parallel_mesh_in_one_line_before_starting_ranks(tmp_path: Path) -> None:
    overrides = [
        "recipe=demo",
        f"paths.cache_dir={tmp_path / 'cache'}",
        f"paths.output_dir={tmp_path / 'run'}",
        "trainer=model_parallel",
        "trainer.accelerator=cpu",
        "trainer.strategy.tensor_parallel_size=2",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, *DEMO])
    with pytest.raises(
        SystemExit,
        match=r"^error: trainer.strategy.tensor_parallel_size=2: .*expected 1, "
        r"with trainer.strategy.data_parallel_size",
    ):
        run(cfg)
    assert not (tmp_path / "cache").exists()  # refused before the data was generated
