"""Wall-clock time of the demo (`python train.py`) with emulated and with real fp16 on this CPU.

Runs `train.py` as a user does, alternating the legs round by round so that a load that comes and
goes (a shared machine) falls on all of them, and prints each leg's wall-clock and CPU times
(user + system, of the run and its children: what a shared machine's load changes least) and
their medians:

* ``emulated``: the whole demo with ``precision.emulate=true`` (what ``auto`` picks on a CPU),
* ``emulated-<N>`` and ``real-<N>``: the demo cut to its first N steps, emulated and real fp16
  (real fp16 kernels on a CPU without fp16 units take minutes for the whole demo).

The dataset is generated once before the timed runs. Usage::

    python bench/demo_time.py --rounds 3 --steps 60
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import resource
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


def _version(package: str) -> str:
    """An installed package's version (the demo's numbers and times depend on torch's and Lightning's)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train(overrides: list[str], run_dir: Path, env: dict[str, str]) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one `python train.py ...`; fails loudly if the run fails."""
    start, cpu_start = time.perf_counter(), _children_cpu_seconds()
    result = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "++trainer.enable_progress_bar=false", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    elapsed, cpu = time.perf_counter() - start, _children_cpu_seconds() - cpu_start
    if result.returncode != 0:
        raise SystemExit(f"train.py {' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    return elapsed, cpu


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
        times: dict[str, list[tuple[float, float]]] = {leg: [] for leg in legs}
        for round_index in range(args.rounds):
            for leg, overrides in legs.items():
                times[leg].append(train(overrides, Path(scratch) / f"{leg}-{round_index}", env))
                wall, cpu = times[leg][-1]
                print(f"round {round_index}: {leg:<14} {wall:7.1f} s wall {cpu:7.1f} s CPU", flush=True)

    print(
        f"\nCPU: {cpu_model()}, {os.cpu_count()} logical cores; {time.strftime('%Y-%m-%d')}; Python "
        f"{platform.python_version()}, torch {_version('torch')}, Lightning {_version('lightning')}"
    )
    for leg, runs in times.items():
        walls, cpus = zip(*runs)
        print(
            f"{leg:<14} median {statistics.median(walls):7.1f} s wall, {statistics.median(cpus):7.1f} s CPU   "
            f"runs (wall/CPU): {', '.join(f'{w:.1f}/{c:.1f}' for w, c in runs)}"
        )


if __name__ == "__main__":
    main()
