"""The documentation's results pages, generated from the benches' JSON (and the README's results table).

Two steps. First record a run: the bench writes its JSON into ``docs/results/data/NAME.json`` and
this script writes beside it what the pages state about the run (``NAME.run.json``: the command,
the commit and whether the code had uncommitted changes, the date, the machine, the Python, torch
and Lightning versions, the wall time), and keeps the run's console output (``NAME.out.txt``).
``record --add`` runs a command that adds rows to a recorded run (``compare_training.py --merge``)
and lists its provenance beside the first's:

    python bench/docs_results.py record overhead --title "ResNet-50, one CPU thread" -- \\
        python bench/overhead.py --rounds 41 --json docs/results/data/overhead.json
    python bench/docs_results.py record demo --title "python train.py" -- python train.py
    python bench/docs_results.py record training --add --note "The machine was shared." -- \\
        python bench/compare_training.py --tasks resnet segnet --steps 200 --seeds 3 \\
        --methods fp16-gs-paper e5m2-gs-paper --merge docs/results/data/training.json

Then write the pages (``docs/results/*.md``, the training figures, and the table between the
README's ``results`` markers), from every recorded run, with no hand-edited number:

    python bench/docs_results.py            # write
    python bench/docs_results.py --check    # exit 1 if a page differs from what the data gives

A run's page follows from its command's script: ``bench/compare_training.py`` and
``bench/ssd_finetune.py`` (training), ``bench/overhead.py`` and ``bench/gpu_estimate.py`` (overhead),
``bench/memory.py`` (memory), ``bench/update_cost.py`` (update cost), ``bench/fidelity.py`` (fidelity),
``train.py`` (the demo's printed output).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "results"
DATA = DOCS / "data"
README = ROOT / "README.md"
README_START, README_END = "<!-- results:start (bench/docs_results.py writes this table) -->", "<!-- results:end -->"
CODE_PATHS = ("gs_lightning", "bench", "train.py", "conf", "recipes")  # what a run's numbers depend on
GENERATOR = "python bench/docs_results.py"


# ---------------------------------------------------------------------------------------------- recording


def machine() -> str:
    """CPU model, logical cores, memory, GPU if any, and the load when the run started."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} logical cores"
    try:
        kib = int(
            next(
                line.split()[1]
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")
            )
        )
        text += f", {kib / 2**20:.0f} GiB memory"
    except (OSError, StopIteration):
        pass
    gpu = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False
        )
        if _has("nvidia-smi")
        else None
    )
    text += (
        f", GPU {gpu.stdout.strip()}" if gpu is not None and gpu.returncode == 0 and gpu.stdout.strip() else ", no GPU"
    )
    if hasattr(os, "getloadavg"):
        text += f"; load average {os.getloadavg()[0]:.1f} at the start"
    return text


def _has(program: str) -> bool:
    return any((Path(folder) / program).exists() for folder in os.environ.get("PATH", "").split(os.pathsep))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def versions() -> dict[str, str]:
    """The versions a run's numbers depend on besides the commit: Python, torch and Lightning."""
    installed = {}
    for package in ("torch", "lightning"):
        try:
            installed[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            installed[package] = "not installed"
    return {"python": platform.python_version(), **installed}


def record(name: str, title: str | None, command: list[str], add: bool = False, note: str | None = None) -> int:
    """Run ``command`` from the repository root, keep its output, and write ``NAME.run.json``.

    With ``add``, the command adds rows to a recorded run's JSON (e.g. ``compare_training.py --merge``):
    ``NAME.run.json`` keeps its provenance and lists this command's under ``additions``, and its output is
    appended to ``NAME.out.txt``. ``note``: a sentence the page shows after the provenance.
    """
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
        raise SystemExit(f"error: run name {name!r}: expected lowercase letters, digits, '-' and '_'")
    if not command:
        raise SystemExit("error: record needs the command to run after '--'")
    run_json = DATA / f"{name}.run.json"
    if add and not run_json.exists():
        raise SystemExit(f"error: record --add {name}: no {run_json} to add to; record it first")
    if not add and not title:
        raise SystemExit("error: record needs --title (the section's title on its results page)")
    DATA.mkdir(parents=True, exist_ok=True)
    provenance = {
        "title": title,
        "command": shlex.join(command),
        "commit": _git("rev-parse", "--short=12", "HEAD").strip(),
        "uncommitted": _git("status", "--porcelain", "--", *CODE_PATHS).splitlines(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        **versions(),
    }
    if note:
        provenance["note"] = note
    if add:
        del provenance["title"]
    start = time.perf_counter()
    with open(DATA / f"{name}.out.txt", "a" if add else "w") as out:
        if add:
            out.write(f"\n$ {provenance['command']}\n")
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            out.write(line)
        returncode = process.wait()
    provenance["seconds"] = round(time.perf_counter() - start, 1)
    provenance["returncode"] = returncode
    if returncode != 0:
        print(f"error: the command exited with {returncode}; {name}.run.json not written", file=sys.stderr)
        return returncode
    if add:
        recorded = json.loads(run_json.read_text())
        recorded["additions"] = [*recorded.get("additions", []), provenance]
        provenance = recorded
    run_json.write_text(json.dumps(provenance, indent=1) + "\n")
    print(f"recorded {run_json} ({time.perf_counter() - start:.0f} s); now: {GENERATOR}")
    return 0


# ---------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Recorded:
    """One recorded run: its name, provenance, the bench's JSON (``None`` for the demo) and output."""

    name: str
    provenance: dict[str, Any]
    data: Any
    output: str

    @property
    def script(self) -> str:
        words = shlex.split(self.provenance["command"])
        return next((Path(w).name for w in words if w.endswith(".py")), "")

    def provenance_lines(self) -> list[str]:
        lines = ["```bash", self.provenance["command"], "```", "", f"Measured here: {_measured(self.provenance)}", ""]
        for added in self._standing_additions():
            lines += [
                "Rows added later to the same JSON (`--merge`) by:",
                "",
                "```bash",
                added["command"],
                "```",
                "",
                f"Measured here: {_measured(added)}",
                "",
            ]
        return lines

    def added_methods(self) -> set[str]:
        """The method keys later commands added (their ``--methods``), whose seconds were measured apart."""
        return {method for added in self.provenance.get("additions", []) for method in _option(added, "--methods")}

    def _standing_additions(self) -> list[dict[str, Any]]:
        """The later commands some row still comes from: one whose tasks and methods a later one all ran again is
        left out (its rows were replaced; the JSON keeps its record)."""
        additions = self.provenance.get("additions", [])
        base_tasks = _option(self.provenance, "--tasks")
        rows = [
            {(t, m) for t in (_option(a, "--tasks") or base_tasks) for m in _option(a, "--methods")} for a in additions
        ]
        return [added for i, added in enumerate(additions) if not rows[i] or not rows[i] <= set().union(*rows[i + 1 :])]


def _option(provenance: dict[str, Any], flag: str) -> list[str]:
    """The words after ``flag`` in a recorded command, up to the next option (none where it has no ``flag``)."""
    words = shlex.split(provenance["command"])
    if flag not in words:
        return []
    rest = words[words.index(flag) + 1 :]
    return rest[: next((i for i, w in enumerate(rest) if w.startswith("-")), None)]


def _measured(provenance: dict[str, Any]) -> str:
    """Where and on what a run's numbers were measured: commit, date, wall time, machine, versions, note."""
    p = provenance
    code = f"commit `{p['commit']}`"
    if p["uncommitted"]:
        code += " with uncommitted changes in " + ", ".join(f"`{line[3:]}`" for line in p["uncommitted"])
    if "torch" in p:
        versions = f"Python {p['python']}, torch {p['torch']}, Lightning {p['lightning']}"
    else:
        versions = f"Python {p['python']} (torch and Lightning versions not recorded)"
    note = f" {p['note']}" if p.get("note") else ""
    return f"{code}, {p['date']}, {p['seconds']:.0f} s wall clock; machine: {p['machine']}; {versions}.{note}"


def load_runs(data: Path = DATA) -> list[Recorded]:
    """Every recorded run under ``data``, in name order."""
    runs = []
    for path in sorted(data.glob("*.run.json")):
        name = path.name.removesuffix(".run.json")
        bench_json, output = data / f"{name}.json", data / f"{name}.out.txt"
        runs.append(
            Recorded(
                name,
                json.loads(path.read_text()),
                json.loads(bench_json.read_text()) if bench_json.exists() else None,
                output.read_text() if output.exists() else "",
            )
        )
    return runs


# ---------------------------------------------------------------------------------------------- formatting


def number(value: Any, key: str = "") -> str:
    """A cell, formatted by what its column holds (``key``): underflow in percent, times, sizes and counts
    with one decimal, ratios with two, anything else with 3 significant digits."""
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if "underflow" in key:
            if value == 0:
                return "0%"
            if value < 5e-6:  # below what three decimals of a percent show, but not zero: one digit, × 10^k
                mantissa, exponent = f"{100 * value:.0e}".split("e")
                return f"{mantissa}·10{str(int(exponent)).translate(SUPERSCRIPTS)}%"
            return f"{100 * value:.3f}%" if value < 0.01 else f"{100 * value:.2f}%"
        if re.search(r"\b(ms|MiB|s / run|seconds|skipped|iterations|steps)\b", key):
            return f"{value:+.1f}" if key.startswith("added") else f"{value:.1f}"
        if re.search(r"\bratio\b| / ", key):
            return f"{value:.2f}"
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(number(v) for v in value)
    return str(value).replace("|", "\\|")


SUPERSCRIPTS = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> list[str]:
    """A Markdown table of ``rows`` (dicts), one column per key in first-seen order."""
    columns = columns or list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(number(row.get(c), c) for c in columns) + " |" for row in rows]
    return lines + [""]


def settings_line(settings: dict[str, Any]) -> list[str]:
    return ["Settings: " + "; ".join(f"{k} {number(v)}" for k, v in settings.items() if v is not None) + ".", ""]


# ---------------------------------------------------------------------------------------------- training runs


def _training_methods(script: str) -> dict[str, Any]:
    """The bench's method table (labels and gradient formats), imported from the bench itself."""
    sys.path.insert(0, str(ROOT / "bench"))
    if script == "ssd_finetune.py":
        from ssd_finetune import ALL_METHODS

        return ALL_METHODS
    from compare_training import METHODS

    return METHODS


def _paper_label() -> str:
    """The table's name for GS with the paper's recipe, from the bench."""
    sys.path.insert(0, str(ROOT / "bench"))
    from compare_training import PAPER_LABEL

    return PAPER_LABEL


# grad_rounding: in grads; lockstep: the runs' pairing, shown as the time ratio
IDENTITY = ("task", "method", "seed", "metric_name", "grads", "label", "grad_rounding", "lockstep")


def aggregate(runs: list[dict[str, Any]], methods: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (task, method), seeds aggregated field by field.

    Methods in the bench's table order (rows merged in later sit beside their kin); the metric and
    the final training loss are ``mean ± std``; every other number is the mean over seeds (``None``
    where no seed has one); lists other than ``losses`` and strings are left out, and a field the
    bench adds later becomes a column of its own.
    """
    rows = []
    order = {key: place for place, key in enumerate(methods)}
    ratios = _time_ratios(runs)
    for task in dict.fromkeys(r["task"] for r in runs):
        keys = dict.fromkeys(r["method"] for r in runs if r["task"] == task)
        for key in sorted(keys, key=lambda k: order.get(k, len(order))):
            group = [r for r in runs if r["task"] == task and r["method"] == key]
            method = methods.get(key)
            row: dict[str, Any] = {
                "task": task,
                "method key": key,
                "gradients": group[0].get("grads") or (method.grads if method else ""),
                "method": group[0].get("label") or (method.label if method else key),
                "seeds": len(group),
                f"{group[0]['metric_name']} (mean ± std)": _mean_std([r["metric"] for r in group]),
                "final train loss": _mean_std([_final_loss(r["losses"]) for r in group]),
            }
            for field in dict.fromkeys(k for r in group for k in r):
                if field in IDENTITY or field in ("metric", "losses", "skips"):  # skips: listed below the tables
                    continue
                values = [_flatten(field, r.get(field)) for r in group]
                for sub in dict.fromkeys(k for v in values for k in v):
                    numbers = [
                        v[sub]
                        for v in values
                        if isinstance(v.get(sub), (int, float)) and not isinstance(v.get(sub), bool)
                    ]
                    if numbers:
                        row[sub] = statistics.fmean(numbers)
                    elif all(v.get(sub) is None for v in values):
                        row[sub] = None
            measured = ratios.get((task, row["gradients"], key))
            row[TIME_RATIO] = statistics.fmean(measured) if measured else None
            rows.append(row)
    return rows


TIME_RATIO = "s ÷ dynamic loss scale"  # mean over seeds of each seed's ratio, stepped in lockstep with it


def _time_ratios(runs: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[float]]:
    """The bench's per-seed time ratios to the dynamic loss scale (``compare_training.time_ratios``); none for runs
    not trained in lockstep with it."""
    sys.path.insert(0, str(ROOT / "bench"))
    from compare_training import Run, time_ratios

    fields = set(Run.__dataclass_fields__)
    return time_ratios([Run(**{k: v for k, v in r.items() if k in fields}) for r in runs if "lockstep" in r])


def _flatten(field: str, value: Any) -> dict[str, Any]:
    """A field as named scalars: a dict's numbers become ``field: key`` (e.g. per-group underflow)."""
    if isinstance(value, dict):
        return {f"{field}: {k}": v for k, v in value.items() if v is None or isinstance(v, (int, float))}
    if isinstance(value, (list, str)):
        return {}
    return {field: value}


def _final_loss(losses: list[float]) -> float:
    """Mean training loss over the last tenth of the steps (as the bench prints it)."""
    tail = losses[-max(1, len(losses) // 10) :]
    return statistics.fmean(tail) if tail else math.nan


def _mean_std(values: list[float]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return "nan"
    std = statistics.stdev(finite) if len(finite) > 1 else 0.0
    missing = len(values) - len(finite)
    return f"{statistics.fmean(finite):.3f} ± {std:.3f}" + (f" ({missing} not finite)" if missing else "")


def _columns_named(row: dict[str, Any]) -> dict[str, str]:
    """Column titles readers know: the bench's field names made readable."""
    names = {
        "skipped_steps": "skipped steps",
        "underflow": "GEMM-gradient underflow",
        "seconds": "s / run",
        "update_iterations": "GS update iterations",
        "oracle_underflow": "oracle underflow",
        "recomputed_steps": "GS recomputed steps",
        "retried_steps": "GS retried steps",
    }
    return {k: names.get(k, k.replace("_", " ")) for k in row}


# What separates the methods, then how each run ended; any other column the bench adds goes to a third table.
SEPARATING = (
    "gradients",
    "method",
    "skipped steps",
    "GEMM-gradient underflow",
    "oracle underflow",
    "s / run",
    TIME_RATIO,
)
OUTCOME = ("gradients", "method", "final train loss", "GS update iterations", "GS retried steps", "GS recomputed steps")
NOT_SHOWN = ("task", "method key", "seeds")  # the section's title, the table's order, the sentence above it


def _task_rows(run: Recorded) -> dict[str, list[dict[str, Any]]]:
    """The run's aggregated rows, titled as the page shows them, per task."""
    rows = aggregate(run.data, _training_methods(run.script))
    titled = [{_columns_named(row)[k]: v for k, v in row.items()} for row in rows]
    return {task: [row for row in titled if row["task"] == task] for task in dict.fromkeys(r["task"] for r in titled)}


def training_section(run: Recorded) -> list[str]:
    steps = {len(r["losses"]) for r in run.data}
    lines = [f"## {run.provenance['title']}", "", *run.provenance_lines()]
    added = run.added_methods()
    for task, rows in _task_rows(run).items():
        # GS's rows in bold, as the figure's labels
        rows = [
            {**row, "method": f"**{row['method']}**" if row["method"].startswith("GS") else row["method"]}
            for row in rows
        ]
        metric = next(k for k in rows[0] if k.endswith("(mean ± std)"))
        outcome = [*OUTCOME[:2], metric, *OUTCOME[2:]]
        others = [
            k for k in dict.fromkeys(k for row in rows for k in row) if k not in (*SEPARATING, *outcome, *NOT_SHOWN)
        ]
        seeds = sorted({row["seeds"] for row in rows})
        title = TASK_TITLES.get(task, task)
        later = [f"{row['gradients']} {row['method']}" for row in rows if row["method key"] in added]
        lines += [
            f"### {title}",
            "",
            f"![{title}: skipped steps, GEMM-gradient underflow and seconds per run of each method]"
            f"({figure_path(run, task).relative_to(DOCS).as_posix()})",
            "",
            "Per method: steps skipped for an overflowed gradient, GEMM-gradient underflow on a log axis (the tick: "
            "the per-tensor oracle's) and seconds per run"
            + (", hatched where a later command measured them" if later else "")
            + f". `{task}`, {', '.join(map(str, sorted(steps)))} steps, {' or '.join(map(str, seeds))} seeds per "
            "method; every number is the mean over the seeds, the metric and the final train loss (over the last "
            "tenth of the steps) mean ± std.",
            "",
            *markdown_table(rows, list(SEPARATING)),
        ]
        if later:
            lines += [
                f"The rows of {', '.join(later)} were added by the later command above: their *s / run* were "
                "measured on the machine as it was then, and compare with the other rows' only as far as the two "
                "machines' loads were alike.",
                "",
            ]
        lines += markdown_table(rows, outcome)
        if others:
            lines += markdown_table(rows, [*SEPARATING[:2], *others])
        lines += skipped_parameters(run, task, rows)
    return lines + gradient_magnitudes(run)


def skipped_parameters(run: Recorded, task: str, rows: list[dict[str, Any]]) -> list[str]:
    """What overflowed where ``task``'s methods skipped steps (the bench's ``skips``, recorded since 2026-12-07): per
    method, the parameters found non-finite most often; nothing for runs recorded without it."""
    sys.path.insert(0, str(ROOT / "bench"))
    from compare_training import skip_causes

    lines = []
    for row in rows:
        runs = [r for r in run.data if r["task"] == task and r["method"] == row["method key"]]
        skips = [skip for r in runs for skip in r.get("skips") or ()]
        if skips:
            causes = skip_causes(skips)
            steps = f"{len(skips)} skipped step{'s' if len(skips) > 1 else ''} in {len(runs)} runs"
            lines.append(f"- {row['gradients']} {row['method']}, {steps}: {causes}")
    if not lines:
        return []
    return [
        "Skipped steps, and the parameters whose gradients were non-finite at them (at how many of those steps), the "
        "most frequent first:",
        "",
        *lines,
        "",
    ]


def figure_path(run: Recorded, task: str) -> Path:
    return DOCS / "plots" / f"{run.name}-{task}.png"


# Colours by gradient setting; the references (no low-precision gradient) in grey.
SETTING_COLOURS = {
    "fp32": "#8c8c8c",
    "bf16": "#b0b0b0",
    "fp16": "#1f77b4",
    "e5m2": "#ff7f0e",
    "e4m3fn": "#2ca02c",
    "bf16 + e5m2 ∇Y": "#9467bd",
    "bf16 + e4m3fn ∇Y": "#8c564b",
}


def training_figures(run: Recorded) -> list[Path]:
    """Per task, one PNG of what separates the methods: skipped steps, GEMM-gradient underflow (log axis,
    with the per-tensor oracle marked) and seconds per run, one bar per method, grouped by gradient setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    written = []
    added = run.added_methods()
    for task, rows in _task_rows(run).items():
        # One line per method, a heading line before each gradient setting (the references share one).
        lines: list[tuple[str, dict[str, Any] | None]] = []
        for setting in dict.fromkeys(
            "references" if r["gradients"] in ("fp32", "bf16") else r["gradients"] for r in rows
        ):
            lines.append((f"{setting} gradients" if setting != "references" else "references", None))
            lines += [
                (r["method"], r)
                for r in rows
                if ("references" if r["gradients"] in ("fp32", "bf16") else r["gradients"]) == setting
            ]
        y = list(range(len(lines)))
        fig, axes = plt.subplots(
            1, 3, figsize=(7.4, 0.85 + 0.19 * len(lines)), sharey=True, gridspec_kw={"width_ratios": (1, 1.35, 1)}
        )
        bars = [(i, row) for i, (_, row) in enumerate(lines) if row is not None]
        colours = [SETTING_COLOURS.get(row["gradients"], "#444444") for _, row in bars]
        skipped, seconds = axes[0], axes[2]
        skipped.barh([i for i, _ in bars], [row["skipped steps"] for _, row in bars], color=colours, height=0.7)
        for i, row in bars:
            if row["skipped steps"]:
                skipped.text(row["skipped steps"], i, f" {row['skipped steps']:.3g}", va="center", fontsize=6)
        skipped.set_title("skipped steps", fontsize=8)
        skipped.set_xlim(0, max(1.0, max(row["skipped steps"] for _, row in bars)) * 1.25)

        underflow = axes[1]
        values = [v for _, row in bars for v in (row["GEMM-gradient underflow"], row["oracle underflow"]) if v]
        low = 10 ** math.floor(math.log10(min(values))) if values else 1e-6
        underflow.set_xscale("log")
        underflow.set_xlim(low, 1.0)
        for (i, row), colour in zip(bars, colours):
            value, oracle = row["GEMM-gradient underflow"], row["oracle underflow"]
            if value is None:
                underflow.text(low * 1.3, i, "not rounded", va="center", fontsize=6, color="#777777")
            elif value == 0:
                underflow.text(low * 1.3, i, "0", va="center", fontsize=6)
            else:
                underflow.barh(i, value - low, left=low, color=colour, height=0.7)
            if oracle:
                underflow.plot([oracle], [i], marker="|", color="black", markersize=7, linestyle="none")
        underflow.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"$10^{{{math.log10(100 * v):.0f}}}$%"))
        underflow.set_title("GEMM-gradient underflow (log; |: oracle)", fontsize=8)

        seconds.barh(
            [i for i, _ in bars],
            [row["s / run"] for _, row in bars],
            color=colours,
            height=0.7,
            hatch=["///" if row["method key"] in added else "" for _, row in bars],
            edgecolor="white",
        )
        seconds.set_title("seconds per run", fontsize=8)
        for ax in axes:
            ax.grid(axis="x", color="#dddddd", linewidth=0.6)
            ax.set_axisbelow(True)
            ax.tick_params(axis="x", labelsize=6.5)
            for side in ("top", "right"):
                ax.spines[side].set_visible(False)
        skipped.set_yticks(y, [label for label, _ in lines])
        skipped.tick_params(axis="y", length=0, labelsize=7)
        for tick, (_, row) in zip(skipped.get_yticklabels(), lines):
            if row is None:
                tick.set_fontweight("bold")
            elif row["method"].startswith("GS"):
                tick.set_color(SETTING_COLOURS.get(row["gradients"], "#444444"))
                tick.set_fontweight("bold")
        skipped.set_ylim(len(lines) - 0.4, -0.6)
        fig.suptitle(f"{TASK_TITLES.get(task, task)}, mean over the seeds", fontsize=8)
        fig.tight_layout()
        path = figure_path(run, task)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=180)
        plt.close(fig)
        written.append(path)
    return written


def gradient_magnitudes(run: Recorded) -> list[str]:
    """The per-layer gradient magnitudes compare_training printed (``--gradient-magnitudes``), as printed."""
    if run.script != "compare_training.py":
        return []
    sys.path.insert(0, str(ROOT / "bench"))
    from compare_training import GRADIENT_HEADER

    lines = run.output.splitlines()
    blocks = []
    for start in (i for i, line in enumerate(lines) if line.startswith(GRADIENT_HEADER)):
        end = next((i for i in range(start, len(lines)) if lines[i].startswith("Spread:")), len(lines) - 1)
        blocks += [*lines[start : end + 1], ""]
    return blocks


# ---------------------------------------------------------------------------------------------- the other benches


def overhead_section(run: Recorded) -> list[str]:
    data = run.data
    lines = [f"## {run.provenance['title']}", "", *run.provenance_lines(), *settings_line(data["settings"])]
    lines += markdown_table(data["rows"])
    rows = {row["method"]: row for row in data["rows"]}
    timed = next(k for k in data["rows"][0] if k.endswith(" ms"))
    if "GS between updates" in rows and "GradScaler" in rows:
        gs, amp = rows["GS between updates"], rows["GradScaler"]
        lines += [
            f"GS between updates against GradScaler: {gs[timed] - amp[timed]:+.1f} ms, "
            f"{gs[timed] / amp[timed]:.3f}×, {gs['aten ops (backward)'] - amp['aten ops (backward)']:+d} aten ops.",
            "",
        ]
    if data.get("host breakdown"):
        lines += ["Host-side work of GS between updates (no kernels):", ""]
        lines += [f"- {k}: {number(v)}" for k, v in data["host breakdown"].items()] + [""]
    if data.get("gradient passes"):
        lines += [
            "Passes over the parameter gradients: GradScaler makes one (unscale and check); GS two between updates, "
            "the unscale after the backward (`.grad` holds true gradients when `backward()` returns) and the step's "
            "read (which sees what user code wrote, through `.data` too):",
            "",
        ]
        lines += [f"- {k}: {number(v)}" for k, v in data["gradient passes"].items()] + [""]
    return lines


def gpu_estimate_section(run: Recorded) -> list[str]:
    data, assumed = run.data, run.data["assumptions"]
    gpus = "; ".join(
        f"{name} {g['peak TFLOPS']:g} TFLOPS, {g['bandwidth GB/s']:g} GB/s" for name, g in assumed["GPUs"].items()
    )
    lines = [f"## {run.provenance['title']}", "", *run.provenance_lines(), *settings_line(data["settings"])]
    lines += [
        "**An estimate, not a measurement.** The forward and each method's backward and finiteness check ran once "
        "on this CPU under a dispatch mode that counted their aten operations (kernel launches on a GPU), their "
        f"FLOPs and the bytes they read and write. The host is taken to dispatch an operation in "
        f"{number(assumed['host us per operation'])} µs (*host ms*), the GPU to run each kernel at its data "
        f"sheet's peak ({gpus}: a floor), the two overlapping: a section takes the longer. Python that dispatches "
        "no operation (GS's graph walk and hooks: this page's host breakdown, measured on this CPU) is not "
        "counted.",
        "",
    ]
    lines += markdown_table(data["counts"])
    lines += ["Estimated ms per section, and a run's iteration (forward included) over GradScaler's:", ""]
    lines += markdown_table(data["estimates"])
    lines += [
        "On a GPU, `bash bench/gpu_check.sh` measures what this estimates: its overhead stage times these "
        "backwards, and its full-step stage GS against GradScaler at training batch sizes.",
        "",
    ]
    return lines


def memory_section(run: Recorded) -> list[str]:
    data = run.data
    lines = [f"## {run.provenance['title']}", "", *run.provenance_lines(), *settings_line(data["settings"])]
    lines += markdown_table(data["rows"])
    rows = {row["method"]: row for row in data["rows"]}
    kept, not_kept = rows.get("GS between updates, fp32 recompute"), rows.get("GS between updates")
    if kept and not_kept:
        held = kept["held after backward MiB"] - not_kept["held after backward MiB"]
        lines += [
            f"Kept until the step for the fp32 recompute of overflowed weight gradients: {held:.1f} MiB, "
            f"{held / kept['after forward MiB']:.0%} of what the forward left allocated; "
            f"the iteration's peak {kept['peak / plain']:.2f}× a plain backward's with it "
            f"(`recompute_weight_gradients=True`), {not_kept['peak / plain']:.2f}× without (the default).",
            "",
        ]
    return lines


def update_cost_rows(data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per model and per family, as the bench prints them."""
    models, families = [], {}
    for r in data["rows"]:
        row: dict[str, Any] = {"family": r["family"], "model": r["name"]}
        if r["error"]:
            row["exact (update, replay)"] = f"failed: {r['error']}"
            models.append(row)
            continue
        times = r["times"]
        row.update({f"{m} ms": times[m] for m in times})
        row.update({f"{m} / plain": times[m] / times["plain"] for m in times if m != "plain"})
        row["decisions"] = r["decisions"]
        exact = (
            "yes"
            if r["exact_update"] and r["exact_replay"]
            else f"no (update {number(r['exact_update'])}, replay {number(r['exact_replay'])})"
        )
        row["exact (update, replay)"] = exact + (
            f", {r['nondeterministic']} nondeterministic in plain backward" if r["nondeterministic"] else ""
        )
        models.append(row)
    for family in dict.fromkeys(r["family"] for r in data["rows"]):
        ok = [m for m in models if m["family"] == family and "decisions" in m]
        every = [m for m in models if m["family"] == family]
        families[family] = {
            "family": family,
            "models": len(every),
            "median update / plain": statistics.median(m["update / plain"] for m in ok) if ok else None,
            "median replay / plain": statistics.median(m["replay / plain"] for m in ok) if ok else None,
            "bit-exact": f"{sum(m['exact (update, replay)'].split(',')[0] == 'yes' for m in ok)} of {len(ok)}",
            "failed": len(every) - len(ok),
        }
    return models, list(families.values())


def update_cost_section(run: Recorded) -> list[str]:
    models, families = update_cost_rows(run.data)
    lines = [f"## {run.provenance['title']}", "", *run.provenance_lines(), *settings_line(run.data["settings"])]
    lines += ["Per family (update / plain: an update iteration's backward against a plain backward):", ""]
    lines += markdown_table(families) + ["Per model:", ""] + markdown_table(models)
    return lines


def fidelity_section(run: Recorded) -> list[str]:
    lines = [f"## {run.provenance['title']}", "", *run.provenance_lines(), *settings_line(run.data["settings"])]
    return lines + markdown_table(run.data["rows"])


def demo_output(run: Recorded) -> str:
    """The demo's console from its final metrics on, with this machine's paths made generic."""
    text = run.output
    start = text.find("Final metrics:")
    text = text[start:] if start >= 0 else text
    text = re.sub(r"/\S*?/outputs/", "<repo>/outputs/", text)  # wherever the run's checkout was
    text = text.replace(str(ROOT), "<repo>").replace(str(Path.home()), "~")
    text = re.sub(r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}", "<date>", text)
    return text.rstrip() + "\n"


def demo_section(run: Recorded) -> list[str]:
    p = run.provenance
    versions = (
        f"Python {p['python']}, torch {p['torch']} and Lightning {p['lightning']}"
        if "torch" in p
        else f"Python {p['python']} and the torch and Lightning versions of the day (not recorded)"
    )
    return [
        f"## {p['title']}",
        "",
        *run.provenance_lines(),
        f"Which numbers depend on what: the final metrics, the per-layer scales and estimated underflow, and the "
        f"counts of skipped steps, recomputed steps and of backwards that decided the scales are what this commit "
        f"prints with {versions} on this machine's CPU. torch's kernels and random generators decide every "
        "rounding, the initial weights and the order of the batches, and Lightning runs the loop around them "
        "(seeding, validation, the steps it counts): another torch or Lightning version, or a CPU whose instruction "
        "set makes torch pick other kernels, can print other numbers; the same commit on the same versions and CPU "
        "prints these. The layer names, the number of steps (`trainer.max_steps` in `recipes/demo.yaml`), the "
        "table's layout and the files it lists depend on the commit alone.",
        "",
        "What it prints at the end:",
        "",
        "```text",
        *demo_output(run).splitlines(),
        "```",
        "",
    ]


SECTIONS: dict[str, Callable[[Recorded], list[str]]] = {
    "compare_training.py": training_section,
    "ssd_finetune.py": training_section,
    "overhead.py": overhead_section,
    "gpu_estimate.py": gpu_estimate_section,
    "memory.py": memory_section,
    "update_cost.py": update_cost_section,
    "fidelity.py": fidelity_section,
    "train.py": demo_section,
}


@dataclass(frozen=True)
class Page:
    """One results page: the scripts whose runs it shows, a short intro first and, after the runs, the details."""

    file: str
    title: str
    scripts: tuple[str, ...]
    intro: str
    details: tuple[str, ...] = ()
    wide: bool = False


PAGES = (
    Page(
        "training.md",
        "Training beside every baseline",
        ("compare_training.py", "ssd_finetune.py"),
        "Each method trains the same small model from the same weights on the same batches, under CPU "
        "emulation of fp16 and fp8 gradients. What separates the methods is in each task's plot: steps skipped "
        "because a gradient overflowed, the share of gradient values rounding made zero (log axis), and seconds "
        "per run. The metrics of these short runs on generated data are close to each other and mostly noise. "
        "How the runs are made and what each column means: [below](#how-these-runs-are-made).",
        (
            "Tasks: small versions of the paper's three experiments (`segnet`: SegNet-basic on generated "
            "CamVid-format scenes; `resnet`: ResNet-8 on generated images; `ssd`: SSD300 on generated VOC-format "
            "boxes, from scratch) and a task built for the paper's premise, layers whose gradients lie far apart "
            "(`deep`: a plain 16-layer CNN, no normalisation or residuals, whose layers' weights are scaled by "
            "powers of two from 2^-9 to 2^10, per-pixel classes of generated CamVid-format scenes, Adam with "
            "per-layer learning rates that make its fp32 training the unscaled network's; the spread as wide as "
            "fp16's forward allows, see `bench/_training_tasks.py`). Every method trains under CPU emulation of "
            "fp16 (`gs_lightning.simulate.emulate`), from the same initial weights on the same batches.",
            "Gradients *fp16*: fp16 autocast. *e5m2* / *e4m3fn*: the same, with every gradient a backward GEMM "
            "produces rounded to that fp8 format (the fp16 path, the paper's: the GEMM writes the low-precision "
            "result itself; per-tensor current and MX block scaling are handed the GEMM's exact result to scale, "
            "and store what they dequantize in fp16). *bf16 + e5m2 ∇Y* / *bf16 + e4m3fn ∇Y*: the fp8 hardware "
            "path, as Transformer Engine and torchao train, bf16 between GEMMs and the gradient entering each "
            "backward GEMM cast to fp8 from its bf16 value.",
            "Methods: *GS* is this package's `GradientScaler` with its default recipe, each step given a retry "
            "(`scaler.step(optimizer, retry=...)`, as the Lightning plugin gives its closure); *GS, paper's "
            "Algorithm 1* "
            'the same with `recipe="paper"` (`ScalingRecipe.paper()`: Algorithm 1 as published, none of the '
            "rules beyond the paper), so the two rows show what those rules buy and cost. *GS, following the "
            "gradients*: `follow_gradients=True` (opt-in: the step raises a layer's scale as its weight gradients "
            "fall, instead of an update). *GS, fp32 recompute*: `recompute_weight_gradients=True, "
            "retry_overflowed_steps=False`, which recovers an overflowed weight gradient from operands kept until "
            "the step instead of running the step again (its memory: [Memory](memory.md)). *GS, no retry*: "
            "`retry_overflowed_steps=False`, what a loop that gives the step no retry gets (Fabric, Accelerate, "
            "the Hugging Face Trainer): an overflowed step is skipped. "
            "*GS, own input-gradient scales*: `own_input_gradient_scale=True` (opt-in: a GEMM whose weight gradients "
            "hold its scale down sends its input gradient at the scale that gradient needs, bounded by the largest "
            "it sent in recent replays).",
            "*GEMM-gradient underflow*: of each gradient the emulation casts (what a backward GEMM produces, or on "
            "the hardware path what enters it), the fraction of its nonzero exact values that rounding made zero, "
            "averaged over tensors and steps. *Oracle underflow*: the same for the best power-of-two scale of each "
            "tensor, chosen with hindsight and without overflow (what no power-of-two scale per tensor can beat; "
            "current scaling's scales are not powers of two, MX's are per block of 32).",
            "*GS update iterations*: backwards that decided the scales (the others replayed them). *GS retried "
            "steps*: steps whose forward and backward ran again on the same batch after an overflow, instead of "
            "being skipped. *GS recomputed steps*: steps taken after an overflowed weight gradient was recomputed "
            "in fp32 from the operands the replay kept (what that memory buys: [Memory](memory.md)).",
            "Times are wall clock on the machine named, which may have been shared, less the underflow "
            "measurement's own work (the benchmark's, the same for every emulated method; rows recorded before "
            "2026-12-07 13:40 UTC include it, which brought every ratio closer to 1). Under the emulation every "
            "operator of the model passes through a Python dispatch mode (each costs a few times what it costs "
            "without the mode); GS's update statistics are fp32 and run outside it. With the fp32 recompute GS keeps "
            "each GEMM's operands and incoming gradient until the step; with glibc's malloc the memory the backward "
            "allocates meanwhile is fresh and page-faults, where a GPU's caching allocator would reuse its blocks: "
            "on these small tasks that too counts against those rows' seconds.",
            "Generated datasets and short runs from scratch: metrics close to each other are noise; skipped steps "
            "and underflow are what these runs measure.",
        ),
        wide=True,
    ),
    Page(
        "overhead.md",
        "Overhead on the backward pass",
        ("overhead.py", "gpu_estimate.py"),
        "`bench/overhead.py` times one backward (and the step's finiteness check) per method, methods "
        "interleaved round by round, medians: a plain backward, `torch.amp.GradScaler`, a GS update iteration "
        "(statistics and probes) and a GS iteration between updates (replayed scales). It also counts the aten "
        "operations each dispatches (on a GPU, each is a kernel launch). `bench/gpu_estimate.py` turns such "
        "counts, with FLOPs and bytes, into an estimate for a GPU, labelled as one.",
    ),
    Page(
        "memory.md",
        "Memory against a plain backward",
        ("memory.py",),
        "`bench/memory.py` runs one iteration per method from `zero_grad(set_to_none=True)`, the same model and "
        "batch for each, and takes the memory allocated above the iteration's start: after the forward, at the "
        "peak of the backward and the step's finiteness check, and still held after the backward (until the "
        "step). By default GS keeps nothing between updates (an overflowed step runs again instead: "
        "`retry_overflowed_steps`); with `recompute_weight_gradients=True` it keeps each GEMM's saved operand and "
        "incoming gradient until the step, to recompute in fp32 a weight gradient that overflowed (see "
        "[How it works](../how-it-works.md)).",
    ),
    Page(
        "update-cost.md",
        "Update iterations on a model zoo",
        ("update_cost.py",),
        "`bench/update_cost.py` builds third-party models from their configs (torchvision classifiers, timm, "
        "Hugging Face transformers, packed RNNs; timm and transformers when installed), times a plain backward, "
        "a GS update iteration and a GS replay in fp32, and checks that every `.grad` equals plain backward's "
        "bit for bit after both (*exact*).",
        wide=True,
    ),
    Page(
        "fidelity.md",
        "Gradient fidelity against fp32",
        ("fidelity.py",),
        "`bench/fidelity.py` measures, on the same weights and batch, the relative error of all parameter "
        "gradients against fp32 and the fraction of nonzero fp32 activation gradients that underflow to zero: "
        "no scaling, the best fixed loss scale (an oracle found by sweeping 2^0..2^24), GradScaler's steady "
        "state, and GS with the paper's λmin and with this package's default. GS is measured on an update "
        "iteration.",
    ),
    Page(
        "demo.md",
        "The demo",
        ("train.py",),
        "`python train.py` trains SegNet-basic on a generated CamVid-format dataset with gradient scaling "
        "(fp16 emulated on a CPU, real fp16 on a GPU) and prints its final metrics, the per-layer scale table "
        "and where it wrote its files.",
        wide=True,
    ),
)


# ---------------------------------------------------------------------------------------------- headline table


def headline(runs: list[Recorded]) -> list[str]:
    """The README's one table: the main numbers of each results page, with the page they come from."""
    return [
        "| measured here | result | from |",
        "|---|---|---|",
        *[
            f"| {what} | {result} | [{PAGE_TITLES[page]}](docs/results/{page}) |"
            for what, result, page in headline_rows(runs)
        ],
    ]


def page_answer(runs: list[Recorded], page: str) -> list[str]:
    """A results page's answer, first: its rows of the README's table (:func:`headline_rows`)."""
    rows = [(what, result) for what, result, on in headline_rows(runs) if on == page]
    return (
        ["| measured here | result |", "|---|---|", *[f"| {what} | {result} |" for what, result in rows], ""]
        if rows
        else []
    )


def headline_rows(runs: list[Recorded]) -> list[tuple[str, str, str]]:
    """(what was measured, its main numbers, the results page they come from), run by run."""
    rows: list[tuple[str, str, str]] = []
    # the training tables last, the paper's experiments first (stable: the other runs keep their order)
    for run in sorted(runs, key=lambda r: _task_order(r) if r.script == "compare_training.py" else -1):
        if run.script == "compare_training.py":
            aggregated = aggregate(run.data, _training_methods(run.script))
            for task, grads in dict.fromkeys((r["task"], r["gradients"]) for r in aggregated):
                group = {
                    r["method"]: r
                    for r in aggregated
                    if (r["task"], r["gradients"]) == (task, grads) and r["underflow"] is not None
                }
                cells = [
                    f"{method}: {group[method]['skipped_steps']:.1f} skipped steps, "
                    f"{number(group[method]['underflow'], 'underflow')} underflow"
                    for method in HEADLINE_METHODS
                    if method in group
                ]
                if "GS" in group and len(cells) > 1:
                    oracle, ratio = group["GS"].get("oracle_underflow"), group["GS"].get(TIME_RATIO)
                    floor = (
                        f" (per-tensor oracle on GS's run: {number(oracle, 'underflow')})" if oracle is not None else ""
                    )
                    floor += f"; GS's run time {ratio:.2f}× the dynamic loss scale's" if ratio is not None else ""
                    rows.append(
                        (
                            f"{TASK_TITLES.get(task, task)}, {grads} gradients: skipped steps, GEMM-gradient underflow",
                            "; ".join(cells) + floor,
                            "training.md",
                        )
                    )
        elif run.script == "overhead.py":
            settings, timed = run.data["settings"], next(k for k in run.data["rows"][0] if k.endswith(" ms"))
            size = f"batch {settings['batch size']} at {settings['image size']}²"
            what = f"{settings['arch']} {timed.removesuffix(' ms')}, {size}, on {settings['device']}" + (
                ", torch.compile" if settings.get("torch.compile backend") else ""
            )
            rows.append(
                (
                    f"{what}: time against a plain backward",
                    "; ".join(f"{r['method']} {r['ratio vs plain']:.2f}×" for r in run.data["rows"][1:]),
                    "overhead.md",
                )
            )
        elif run.script == "gpu_estimate.py":
            settings, every = run.data["settings"], run.data["estimates"][0]
            key = next(k for k in every if k.startswith("GS ÷ GradScaler"))
            rows.append(
                (
                    f"ESTIMATE for a GPU, not a measurement: {settings['arch']} batch {settings['batch size']} at "
                    f"{settings['image size']}², an iteration with GS against GradScaler's, "
                    f"{key.removeprefix('GS ÷ GradScaler, ')} iterations",
                    "; ".join(f"{r['GPU']} {r[key]:.2f}×" for r in run.data["estimates"]),
                    "overhead.md",
                )
            )
        elif run.script == "memory.py":
            settings = run.data["settings"]
            size = f"batch {settings['batch size']} at {settings['image size']}²"
            what = f"{settings['arch']} {size} on {settings['device']}"
            rows.append(
                (
                    f"{what}: peak memory of an iteration against a plain backward's",
                    "; ".join(f"{r['method']} {r['peak / plain']:.2f}×" for r in run.data["rows"][1:]),
                    "memory.md",
                )
            )
        elif run.script == "update_cost.py":
            _, families = update_cost_rows(run.data)
            rows.append(
                (
                    f"GS update iteration against a plain backward, model zoo ({run.provenance['title']}), "
                    "median per family",
                    "; ".join(
                        f"{f['family']} {f['median update / plain']:.2f}×"
                        for f in families
                        if f["median update / plain"] is not None
                    ),
                    "update-cost.md",
                )
            )
        elif run.script == "fidelity.py":
            rows.append(
                (
                    "GS gradient error against fp32, ÷ the best fixed loss scale's",
                    "; ".join(
                        f"{r['model']} {r['GS error / best fixed']:.2f}×"
                        for r in run.data["rows"]
                        if r["GS error / best fixed"] is not None and "default" in r["method"]
                    ),
                    "fidelity.md",
                )
            )
    return rows


# compare_training's methods the README's table sets side by side, in each gradient setting that has GS and one of
# the others: the dynamic loss scale (what fp16 users run today) and per-tensor current scaling, alone and under a
# dynamic loss scale
# (the strongest per-tensor fp8 anchors)
HEADLINE_METHODS = (
    "GS",
    "dynamic loss scale",
    "per-tensor current (TE current)",
    "per-tensor current + dynamic loss scale",
)
PAGE_TITLES = {page.file: page.title for page in PAGES}
# compare_training's tasks, as the page's intro names them
TASK_TITLES = {
    "resnet": "ResNet-8",
    "segnet": "SegNet-basic",
    "ssd": "SSD300",
    "deep": "Plain CNN-16 with scaled layers",
}


# ---------------------------------------------------------------------------------------------- writing


def pages(runs: list[Recorded], draw: bool = False) -> dict[Path, str]:
    """Every generated file's text, by path (``draw``: also draw the training figures)."""
    header = f"<!-- Generated by `{GENERATOR}` from docs/results/data/; do not edit. -->"
    files: dict[Path, str] = {}
    index = [
        header,
        "",
        "# Results",
        "",
        "Every number on these pages is measured here, by a run of this repository's code whose command, "
        "commit, date and machine head its section. The pages are generated from the runs' JSON by "
        f"`{GENERATOR}`; to add or renew a run, see that script's docstring.",
        "",
        "| page | runs |",
        "|---|---|",
    ]
    for page in PAGES:
        selected = [run for run in runs if run.script in page.scripts]
        if not selected:
            continue
        # Material's front matter: a wide page (its tables and figures) gives the content the navigation's width.
        front = ["---", "hide:", "  - navigation", "---", ""] if page.wide else []
        lines = [*front, header, "", f"# {page.title}", "", page.intro, ""]
        if page.file == "training.md":
            selected.sort(key=_task_order)
            lines += training_answer(selected)
        else:
            lines += page_answer(selected, page.file)
        for run in selected:
            lines += SECTIONS[run.script](run)
            if draw and run.script in TRAINING_SCRIPTS:
                training_figures(run)
        if page.details:
            lines += ["## How these runs are made", ""] + [line for text in page.details for line in (text, "")]
        files[DOCS / page.file] = "\n".join(lines).rstrip() + "\n"
        index.append(
            f"| [{page.title}]({page.file}) | " + "; ".join(run.provenance["title"] for run in selected) + " |"
        )
    index += ["", "## At a glance", "", *[line.replace("(docs/results/", "(") for line in headline(runs)], ""]
    unrecorded = sorted(
        f"`bench/{script}`"
        for script in SECTIONS
        if script.endswith(".py") and script != "train.py" and not any(run.script == script for run in runs)
    )
    if unrecorded:
        index += [f"Not run for these pages: {', '.join(unrecorded)}.", ""]
    if all("no GPU" in run.provenance["machine"] for run in runs):
        index += [
            "No run on a GPU is recorded here: `bash bench/gpu_check.sh` runs the fidelity, overhead and "
            "zoo benches on one CUDA GPU at realistic sizes.",
            "",
        ]
    files[DOCS / "index.md"] = "\n".join(index)
    demo = [run for run in runs if run.script == "train.py"]
    if demo:
        files[DOCS / "demo-output.txt"] = demo_output(demo[-1])
    return files


TRAINING_SCRIPTS = ("compare_training.py", "ssd_finetune.py")


def _task_order(run: Recorded) -> int:
    """The paper's experiments first, then the task built for its premise (``TASK_TITLES``' order)."""
    order = list(TASK_TITLES)
    tasks = [order.index(r["task"]) for r in run.data if r["task"] in order]
    return min(tasks, default=len(order))


def training_answer(runs: list[Recorded]) -> list[str]:
    """The page's answer first: per task and gradient format, skipped steps and GEMM-gradient underflow of GS,
    of the paper's Algorithm 1 and of the methods the README sets beside GS."""
    methods = ("GS", _paper_label(), *HEADLINE_METHODS[1:])
    rows = []
    for run in runs:
        for task, task_rows in _task_rows(run).items():
            for grads in dict.fromkeys(r["gradients"] for r in task_rows):
                group = {
                    r["method"]: r
                    for r in task_rows
                    if r["gradients"] == grads and r["GEMM-gradient underflow"] is not None
                }
                if "GS" in group and len(group.keys() & set(methods)) > 1:
                    row = {"task": TASK_TITLES.get(task, task), "gradients": grads}
                    for method in methods:
                        if method in group:
                            cell = group[method]
                            underflow = number(cell["GEMM-gradient underflow"], "underflow")
                            row[method] = f"{cell['skipped steps']:.1f}\u00a0·\u00a0{underflow}"  # no break inside
                    rows.append(row)
    if not rows:
        return []
    columns = ["task", "gradients", *(m for m in methods if any(m in row for row in rows))]
    return [
        "Skipped steps · GEMM-gradient underflow, mean over the seeds (— where the method was not run with that "
        "gradient format):",
        "",
        *markdown_table(rows, columns),
    ]


def readme_with_table(readme: str, table: list[str]) -> str:
    if README_START not in readme or README_END not in readme:
        raise SystemExit(f"error: README.md has no {README_START!r} ... {README_END!r} block for the results table")
    before, rest = readme.split(README_START, 1)
    _, after = rest.split(README_END, 1)
    return before + README_START + "\n" + "\n".join(table) + "\n" + README_END + after


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "record":
        parser = argparse.ArgumentParser(
            prog="docs_results.py record", description="run a bench and record where its numbers come from"
        )
        parser.add_argument("name", help="the run's name: its files are docs/results/data/NAME.*")
        parser.add_argument("--title", help="the section's title on its results page (required unless --add)")
        parser.add_argument(
            "--add",
            action="store_true",
            help="the command adds rows to the recorded run NAME (e.g. compare_training.py --merge): keep its "
            "provenance and list this command's beside it",
        )
        parser.add_argument(
            "--note", help="a sentence the page shows after the run's provenance (e.g. that the machine was shared)"
        )
        split = argv.index("--") if "--" in argv else len(argv)
        args = parser.parse_args(argv[1:split])
        return record(args.name, args.title, argv[split + 1 :], add=args.add, note=args.note)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated page is out of date")
    args = parser.parse_args(argv)
    runs = load_runs()
    if not runs:
        raise SystemExit(f"error: no recorded run under {DATA}; record one first (see {GENERATOR} --help)")
    files = pages(runs, draw=not args.check)
    files[README] = readme_with_table(README.read_text(), headline(runs))
    stale = [path for path, text in files.items() if not path.exists() or path.read_text() != text]
    # The figures are drawn from the same data; a missing one is out of date (matplotlib's bytes vary by version).
    stale += [
        figure_path(run, task)
        for run in runs
        if run.script in TRAINING_SCRIPTS
        for task in dict.fromkeys(r["task"] for r in run.data)
        if not figure_path(run, task).exists()
    ]
    if args.check:
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)} (run {GENERATOR})", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
