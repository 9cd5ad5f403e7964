"""A SIGTERM sent to the whole job (SLURM, ``timeout``) while DataLoader workers start ends none of them: the main
process gets it, and Lightning stops the run there (``tests/test_app_signals.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gs_lightning.data.base import JobDataLoader, _worker_init

pytestmark = pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")

# Starts a loader's workers over and over for 3 s, counting the SIGTERMs its main process receives.
EPOCHS = textwrap.dedent(
    """
    import signal, sys, time
    from torch.utils.data import DataLoader
    from gs_lightning.data.base import JobDataLoader, _worker_init

    received = []
    signal.signal(signal.SIGTERM, lambda *_: received.append(1))
    loader = {loader}(list(range(8)), batch_size=4, num_workers=2, worker_init_fn=_worker_init)
    print("ready", flush=True)
    epochs, deadline = 0, time.monotonic() + 3
    while time.monotonic() < deadline:
        for _ in loader:
            pass
        epochs += 1
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # done: the signals still coming are the test's
    print(f"{{epochs}} epochs, {{len(received)}} SIGTERMs", flush=True)
    """
)


def _signalled_run(loader: str) -> subprocess.CompletedProcess:
    """The script above, its process group sent SIGTERM every 2 ms while it runs."""
    process = subprocess.Popen(
        [sys.executable, "-c", EPOCHS.format(loader=loader)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert process.stdout.readline().strip() == "ready"
    while process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.002)
    out, err = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_a_sigterm_to_the_job_while_workers_start_reaches_only_the_main_process() -> None:
    run = _signalled_run("JobDataLoader")
    assert run.returncode == 0 and "killed by signal" not in run.stderr, run.stderr[-2000:]
    epochs, signals = (int(word) for word in run.stdout.split()[::2])
    assert epochs > 1 and signals > 0


def test_a_plain_loader_loses_a_worker_to_the_same_signals() -> None:
    """What the test above guards against: with torch's DataLoader a worker that starts as the signal comes
    dies of it, even with the same worker_init_fn."""
    run = _signalled_run("DataLoader")
    assert run.returncode != 0 and "killed by signal: Terminated" in run.stderr


def test_workers_ignore_sigterm_and_the_main_process_keeps_its_mask() -> None:
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    loader = JobDataLoader(_WorkerSignals(), batch_size=1, num_workers=2, worker_init_fn=_worker_init, collate_fn=list)
    seen = [item for batch in loader for item in batch]
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    assert seen and all(ignored and not blocked for ignored, blocked in seen)


class _WorkerSignals:
    """Each item: (SIGTERM ignored, SIGTERM blocked) in the process that loads it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[bool, bool]:
        ignored = signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        return ignored, signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
