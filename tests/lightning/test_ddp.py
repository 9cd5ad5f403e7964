"""GradientScalingPlugin under DDP on CPU: 2 processes, gloo, in lightning.pytorch and pytorch_lightning.

The ranks all-reduce true gradients (each rank unscales its own before accumulation, with scales of
its own), so after a few steps both ranks hold the same weights, and those match a single process
that sees the whole global batch. A step that overflows on one rank only is skipped on both, since
the all-reduce carries the inf to every rank.

Run as a script (``PYTHONPATH=tests python tests/lightning/test_ddp.py PACKAGE STRATEGY OUT_DIR``) this file is also
the training program of the ``strategy="ddp"`` test: Lightning launches rank 1 by running it again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA, Classifier
from lightning_packages import on_package
from torch.utils.data import DataLoader, TensorDataset

from gs_lightning import GradientScalingPlugin

GLOBAL_BATCH, INF_STEP = 8, 2
STEPS = len(DATA) // GLOBAL_BATCH


class ShardedClassifier(Classifier):
    """Overflows at ``INF_STEP`` on rank 0 only; saves its weights and scaler counters when training ends."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        return loss * float("inf") if self.global_step == INF_STEP and self.global_rank == 0 else loss

    def train_dataloader(self) -> DataLoader:
        # Rank r takes samples r, r + world, ...: each global batch is the single process's batch, in order
        # (Lightning's own DistributedSampler would shuffle).
        world, rank = self.trainer.world_size, self.global_rank
        x, y = DATA.tensors
        return DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=GLOBAL_BATCH // world)

    def on_train_end(self) -> None:
        scaler = self.trainer.precision_plugin.scaler
        result = {
            "params": [p.detach().clone() for p in self.parameters()],
            "skipped_steps": scaler.skipped_steps,
            "iteration": scaler.iteration,
        }
        torch.save(result, Path(self.out_dir) / f"rank{self.global_rank}.pt")


def train(package: str, strategy: str, devices: int, out_dir: Path) -> None:
    """Fit from the same initial weights on the same global batches of 8, sharded over the ranks."""
    torch.manual_seed(0)
    model = on_package(ShardedClassifier, package)(str(out_dir))
    trainer = import_module(package).Trainer(
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


def check_against_single_process(ddp_dir: Path, single_dir: Path) -> None:
    rank0, rank1 = (torch.load(ddp_dir / f"rank{r}.pt") for r in (0, 1))
    single = torch.load(single_dir / "rank0.pt")
    for a, b, c in zip(rank0["params"], rank1["params"], single["params"]):
        assert torch.equal(a, b)  # identical on both ranks
        torch.testing.assert_close(a, c, rtol=1e-3, atol=2e-4)  # and the single-process trajectory
    for result in (rank0, rank1, single):
        assert result["skipped_steps"] == 1 and result["iteration"] == STEPS
        assert all(torch.isfinite(p).all() for p in result["params"])


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single")
    train("lightning.pytorch", "auto", 1, out)
    return out


# pytorch_lightning runs the "ddp" launcher only: each DDP run costs ~30 s on a 2-core CPU, and
# "ddp_spawn" would pickle the test model by name, which finds the lightning.pytorch class.
@pytest.mark.parametrize(
    "package, strategy",
    [("lightning.pytorch", "ddp_spawn"), ("lightning.pytorch", "ddp"), ("pytorch_lightning", "ddp")],
)
def test_ranks_agree_with_each_other_and_a_single_process(
    package: str, strategy: str, single_process: Path, tmp_path: Path
) -> None:
    if strategy == "ddp_spawn":
        train(package, strategy, 2, tmp_path)
    else:  # Lightning's "ddp" launches rank 1 by rerunning the command line: that must be this script, not pytest
        tests = str(Path(__file__).resolve().parents[1])  # conftest and lightning_packages, for both ranks
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
        subprocess.run(
            [sys.executable, __file__, package, strategy, str(tmp_path)], check=True, timeout=120, cwd=tmp_path, env=env
        )
    check_against_single_process(tmp_path, single_process)


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2], 2, Path(sys.argv[3]))
