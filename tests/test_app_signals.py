"""SIGTERM (what SLURM, Kubernetes and ``timeout`` send) stops a run of the app as Ctrl-C does: a
checkpoint of the step it reached, the command line that resumes it, and a non-zero exit (143,
128 + SIGTERM); under SLURM, Lightning's own requeue handlers stay in place and still work."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import Classifier, loader
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.connectors import signal_connector
from test_app import ROOT, _demo_like, _env, _tiny_demo, _weights

from gs_lightning.app import SIGTERM_EXIT_STATUS, run
from gs_lightning.lightning.callback import InterruptCheckpoint


class SignalAtStep(Callback):
    """Sends ``signum`` to this process once training has reached ``step``."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def test_sigterm_exit_status_is_the_shells() -> None:
    assert SIGTERM_EXIT_STATUS == 143


def test_sigterm_saves_the_step_it_reached_and_the_resumed_run_ends_as_an_uninterrupted_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM during step 4 (the first batch of epoch 2, 3 batches an epoch): Lightning ends the fit
    after that batch, interrupted.ckpt holds step 4, the run exits 143 with the resume line; resumed
    to 9 steps it ends with the weights of an uninterrupted run."""
    straight = run(_demo_like(tmp_path / "straight", tmp_path, "trainer.max_steps=9", "test=false"))
    sigterm = f"+callbacks.sigterm_at={{_target_: {__name__}.SignalAtStep, step: 4}}"
    handler = signal.getsignal(signal.SIGTERM)
    with caplog.at_level("INFO", logger="gs_lightning.app"), pytest.raises(SystemExit) as info:
        run(_demo_like(tmp_path / "stopped", tmp_path, "trainer.max_steps=9", "test=false", sigterm))
    assert signal.getsignal(signal.SIGTERM) == handler  # Lightning put the handler back
    assert info.value.code == 143
    checkpoint = tmp_path / "stopped" / "checkpoints" / "interrupted.ckpt"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 4
    assert "Stopped by SIGTERM at step 4 (epoch 1)." in caplog.text and f"Checkpoint:    {checkpoint}" in caplog.text
    assert f"Resume:        python train.py ckpt_path={checkpoint}" in caplog.text
    assert "no InterruptCheckpoint callback" not in caplog.text

    resumed = run(
        _demo_like(tmp_path / "resumed", tmp_path, "trainer.max_steps=9", "test=false", f"ckpt_path={checkpoint}")
    )
    final = [_weights(tmp_path / name / "checkpoints" / "last.ckpt") for name in ("straight", "resumed")]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert resumed["train/loss"] == straight["train/loss"]


def test_sigterm_to_a_real_run_exits_143_with_a_checkpoint_and_a_resume_line_that_works(tmp_path: Path) -> None:
    """``python train.py`` with 2 DataLoader workers, its process group sent SIGTERM (as SLURM and
    ``timeout`` send it: to the workers too) once its first epoch's checkpoint is written: it exits
    143, having saved interrupted.ckpt at the step it says it stopped at, and the printed resume
    command (with a limit 2 steps further) resumes from that checkpoint and trains those 2 steps."""
    args = [*_tiny_demo(100000), "++trainer.enable_progress_bar=false", "test=false", "data.num_workers=2"]
    log = tmp_path / "stopped.out"
    with log.open("w") as out:  # a file, not a pipe: a full pipe would block the run
        process = subprocess.Popen(
            [sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'stopped'}", *args],
            cwd=ROOT,
            env=_env(tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a job's
        )
        first_epoch = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
        deadline = time.monotonic() + 240
        while not first_epoch.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None and first_epoch.exists(), log.read_text()[-3000:]
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)
    output = log.read_text()
    assert process.returncode == 143, output[-3000:]
    # No worker died of the signal: torch's error for one can land anywhere in the main process.
    assert "Traceback" not in output and "killed by signal" not in output, output[-3000:]
    stopped = re.search(r"^Stopped by SIGTERM at step (\d+) \(epoch \d+\)\.$", output, re.MULTILINE)
    assert stopped is not None, output[-3000:]
    step = int(stopped.group(1))
    checkpoint = tmp_path / "stopped" / "checkpoints" / "interrupted.ckpt"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == step >= 2
    assert re.search(rf"^Checkpoint: +{re.escape(str(checkpoint))}$", output, re.MULTILINE)

    command = shlex.split(re.search(r"^Resume: +(.+)$", output, re.MULTILINE).group(1))
    assert command[:2] == ["python", "train.py"] and command[-1] == f"ckpt_path={checkpoint}"
    command = [f"trainer.max_steps={step + 2}" if a == "trainer.max_steps=100000" else a for a in command[2:]]
    resumed = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'resumed'}", *command],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    assert torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step + 2


def test_under_slurm_lightnings_requeue_handlers_stay_and_sigterm_still_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under SLURMEnvironment(auto_requeue=True) the fit runs with Lightning's SIGUSR1 handler (its
    requeue: an hpc checkpoint and ``scontrol requeue``) and its SIGTERM handlers; SIGUSR1 at step 2
    requeues as Lightning does, SIGTERM at step 3 ends the fit with InterruptCheckpoint's checkpoint."""
    for name, value in {
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NAME": "train",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    requeued: list[list[str]] = []
    monkeypatch.setattr(signal_connector, "call", lambda command, **kwargs: requeued.append(command) or 0)
    handlers: dict[str, object] = {}

    class SeeHandlers(Callback):
        def on_train_start(self, trainer: L.Trainer, *args: object) -> None:
            handlers.update(usr1=signal.getsignal(signal.SIGUSR1), term=signal.getsignal(signal.SIGTERM))

    interrupt = InterruptCheckpoint(tmp_path / "checkpoints")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=8,
        plugins=[SLURMEnvironment(auto_requeue=True)],
        callbacks=[SeeHandlers(), SignalAtStep(2, signal.SIGUSR1), SignalAtStep(3), interrupt],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(SystemExit):
        trainer.fit(Classifier(), loader())

    connector = trainer._signal_connector
    assert isinstance(handlers["usr1"], signal_connector._HandlersCompose)
    assert connector._slurm_sigusr_handler_fn in handlers["usr1"].signal_handlers
    assert connector._sigterm_handler_fn in handlers["term"].signal_handlers
    assert requeued == [["scontrol", "requeue", "1234"]]
    assert torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)["global_step"] == 2
    assert trainer.received_sigterm and interrupt.saved == (tmp_path / "checkpoints" / "interrupted.ckpt").resolve()
    assert torch.load(interrupt.saved, weights_only=True)["global_step"] == 3
