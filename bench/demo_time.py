"""Wall-clock time of the demo (`python train.py`) with emulated and with real fp16 on this CPU.

Runs `train.py` as a user does, alternating the legs round by round so that a load that comes and
goes (a shared machine) falls on all of them, and prints each leg's times and median:

* ``emulated``: the whole demo with ``precision.emulate=true`` (what ``auto`` picks on a CPU),
* ``emulated-<N>`` and ``real-<N>``: the demo cut to its first N steps, emulated and real fp16
  (real fp16 kernels on a CPU without fp16 units take minutes for the whole demo).

The dataset is generated once before the timed runs. Usage::

    python bench/demo_time.py --rounds 3 --steps 60
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def train(overrides: list[str], run_dir: Path, env: dict[str, str]) -> float:
    """Seconds one `python train.py ...` takes; fails loudly if the run fails."""
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "++trainer.enable_progress_bar=false", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"train.py {' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each leg (the median is reported)")
    parser.add_argument("--steps", type=int, default=60, help="length of the emulated-vs-real comparison legs")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GS_CACHE_DIR": str(Path(scratch) / "cache")}
        train(["trainer.max_steps=1", "test=false"], Path(scratch) / "warmup", env)  # generates the dataset
        legs = {
            "emulated": ["precision.emulate=true"],
            f"emulated-{args.steps}": ["precision.emulate=true", f"trainer.max_steps={args.steps}"],
            f"real-{args.steps}": ["precision.emulate=false", f"trainer.max_steps={args.steps}"],
        }
        times: dict[str, list[float]] = {leg: [] for leg in legs}
        for round_index in range(args.rounds):
            for leg, overrides in legs.items():
                times[leg].append(train(overrides, Path(scratch) / f"{leg}-{round_index}", env))
                print(f"round {round_index}: {leg:<14} {times[leg][-1]:7.1f} s", flush=True)

    print(f"\nCPU: {cpu_model()}, {os.cpu_count()} logical cores; {time.strftime('%Y-%m-%d')}")
    for leg, seconds in times.items():
        print(f"{leg:<14} median {statistics.median(seconds):7.1f} s   runs: {', '.join(f'{s:.1f}' for s in seconds)}")


if __name__ == "__main__":
    main()
