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


def test_the_parents_sigterm_still_ends_a_worker_so_its_exit_does_not_wait_forever() -> None:
    """A process that exits with its workers still running (a loader's iterator alive at exit) has
    multiprocessing ``terminate()`` them and wait: a worker that ignored SIGTERM outright kept that exit
    waiting forever. The parent's SIGTERM still ends it."""
    script = textwrap.dedent(
        """
        import signal
        from gs_lightning.data.base import JobDataLoader, _worker_init

        before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        loader = JobDataLoader(list(range(8)), batch_size=1, num_workers=2, worker_init_fn=_worker_init)
        iterator = iter(loader)
        next(iterator)
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before, "the main process keeps its mask"
        print("ok", flush=True)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr[-2000:]
