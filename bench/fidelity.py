"""Gradient fidelity of fp16 training methods against fp32 on the paper's networks.

For each network (see ``bench/_models.py``) and one batch, on the same weights:

* none        fp16 autocast, plain backward
* fixed       the best fixed loss scale 2^k, k = 0..24 (an oracle found by sweeping)
* dynamic     GradScaler at its steady state: the largest power of two with finite gradients
* GS paper    GradientScaler(lambda_min="subnormal"), λmin = 2^-24 as in the paper
* GS default  GradientScaler() (lambda_min="normal", λmin = 2^-14)

each compared with fp32 (TF32 off): the relative error of all parameter gradients, and the
fraction of nonzero fp32 activation gradients that underflow to zero. GS is measured on an
update iteration, whose scales come from the gradients at hand; if it overflows, the steps
GradientScaler would skip (backing off its scales) are counted and the first finite one is
measured. Prints a Markdown table, whether GS's error is within 1.5x the best fixed scale's on
every model, and a per-layer breakdown of GS's error for the models where it is not or where
GS overflowed first (for all of them with ``--details``).

    python bench/fidelity.py --device cpu                   # small sizes: 1.5 min on 2 idle cores
    python bench/fidelity.py --device cuda --size realistic # 20 fp32 warm-up steps by default
    python bench/fidelity.py --device cpu --json fidelity.json   # also the settings and rows as JSON
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass

import torch
from _models import MODELS, SIZES, Workload, build

from gs_lightning.analysis.fidelity import Fidelity, FidelityProbe, ScalingRun

TARGET_RATIO = 1.5  # GS's error may be at most this many times the best fixed scale's
FIXED_EXPONENTS = range(0, 25)
DEFAULT_MODELS = ("resnet18", "vgg16", "ssd300", "segnet")
GS_METHODS = {"GS, λmin subnormal (paper)": "subnormal", "GS, λmin normal (default)": "normal"}
DEFAULT_GS = "GS, λmin normal (default)"


@dataclass(frozen=True)
class Row:
    """One model x method result."""

    model: str
    method: str
    scale: str
    fidelity: Fidelity
    ratio: float | None = None  # GS error / best fixed error, for GS rows


@dataclass
class ModelResult:
    """Everything measured on one model, kept for the diagnosis."""

    workload: Workload
    rows: list[Row]
    best_scale: float
    best: Fidelity
    runs: dict[str, ScalingRun]
    seconds: float
    warmup_loss: float | None

    @property
    def ratio(self) -> float:
        """GS (default) error / best fixed error."""
        return _ratio(self.runs[DEFAULT_GS].fidelity.error, self.best.error)


def _ratio(error: float, best: float) -> float:
    return error / best if best > 0 else math.inf


def _pow2(scale: float) -> str:
    return f"2^{int(math.log2(scale))}"


def _gs_scale(run: ScalingRun) -> str:
    """The range of the accumulated per-layer scales GS chose, and the steps it skipped first."""
    totals = [layer.log2_total for layer in run.layers[-1]]
    text = f"2^{min(totals)}..2^{max(totals)}" if totals else "1"
    skipped = len(run.attempts) - 1
    return f"{text}, after {skipped} skipped step{'s' * (skipped != 1)}" if skipped else text


def measure(workload: Workload, warmup_steps: int, seed: int) -> ModelResult:
    """Warm the model up, then measure every method on the next batch."""
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    warmup_loss = workload.warmup(warmup_steps, generator)
    probe = FidelityProbe(workload.model, workload.loss_fn(workload.make_batch(generator)), workload.device.type)
    title = workload.title
    rows = [Row(title, "none", "1", probe.none())]
    best_scale, best = probe.best_fixed(FIXED_EXPONENTS)
    rows.append(Row(title, f"fixed, best of 2^{FIXED_EXPONENTS[0]}..2^{FIXED_EXPONENTS[-1]}", _pow2(best_scale), best))
    dynamic_scale, dynamic = probe.dynamic()
    rows.append(Row(title, "dynamic (GradScaler steady state)", _pow2(dynamic_scale), dynamic))
    runs = {}
    for method, lambda_min in GS_METHODS.items():
        run = runs[method] = probe.gradient_scaling_run(lambda_min=lambda_min)
        rows.append(Row(title, method, _gs_scale(run), run.fidelity, _ratio(run.fidelity.error, best.error)))
    return ModelResult(workload, rows, best_scale, best, runs, time.perf_counter() - start, warmup_loss)


def _fmt(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else str(value)


def _pct(value: float) -> str:
    return f"{_fmt(100 * value)}%"


def table(rows: list[Row]) -> str:
    """The Markdown table of all rows."""
    lines = [
        "| model | method | scale | gradient error | underflow | GS error / best fixed |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = "" if row.ratio is None else f"{_fmt(row.ratio)}x"
        lines.append(
            f"| {row.model} | {row.method} | {row.scale} | {_fmt(row.fidelity.error)} "
            f"| {_pct(row.fidelity.underflow)} | {ratio} |"
        )
    return "\n".join(lines)


def _module(parameter: str) -> str:
    return parameter.rsplit(".", 1)[0]


def _overflow_section(run: ScalingRun, top: int) -> list[str]:
    """Which gradients overflowed on GS's first iteration, and at what scale."""
    first, layers = run.attempts[0], {layer.name: layer for layer in run.layers[0]}
    final = {layer.name: layer for layer in run.layers[-1]}
    overflowed = [p for p in first.parameters if not math.isfinite(p.error)]
    lines = [
        f"GS's first iteration overflowed in {len(overflowed)} parameter gradients; "
        f"{len(run.attempts) - 1} steps were skipped (each backing off the accumulated scale) before "
        f"the gradients were finite. fp16 holds magnitudes up to 65504 < 2^16; "
        f"log2 needed = log2(max |fp32 gradient| x scale):",
        "",
        "| parameter | max abs fp32 grad | GS scale (first) | log2 needed | GS scale (finite) |",
        "|---|---|---|---|---|",
    ]
    for param in sorted(overflowed, key=lambda p: p.reference_max, reverse=True)[:top]:
        layer, last = layers.get(_module(param.name)), final.get(_module(param.name))
        needed = "" if layer is None else f"{math.log2(param.reference_max) + layer.log2_total:.1f}"
        lines.append(
            f"| {param.name} | {param.reference_max:.3g} | {'' if layer is None else layer.log2_total} | {needed} "
            f"| {'' if last is None else last.log2_total} |"
        )
    lines += ["", "Layers whose scale could not meet the underflow target on the first iteration:", ""]
    lines += [
        f"- {layer.name} ({layer.kind}): β = 2^{layer.log2_scale}, accumulated 2^{layer.log2_total}, "
        f"estimated underflow {layer.underflow_rate:.2g}"
        for layer in run.layers[0]
        if layer.underflow_rate > run.scaler.recipe.underflow_rate
    ] or ["- none"]
    return lines + [""]


def diagnosis(result: ModelResult, top: int = 8) -> str:
    """Where GS's error comes from, layer by layer, next to the best fixed scale's."""
    run = result.runs[DEFAULT_GS]
    gs, best, best_log2 = run.fidelity, result.best, int(math.log2(result.best_scale))
    layers = {layer.name: layer for layer in run.layers[-1]}
    best_params = {p.name: p for p in best.parameters}
    lines = [
        f"#### {result.workload.title}: GS (default) error {_fmt(gs.error)} vs best fixed {_fmt(best.error)} "
        f"at 2^{best_log2}",
        "",
    ]
    if len(run.attempts) > 1:
        lines += _overflow_section(run, top)
    lines += [
        f"Parameter-gradient underflow: GS {_pct(gs.weight_underflow)}, best fixed {_pct(best.weight_underflow)}. "
        f"Activation-gradient underflow: GS {_pct(gs.underflow)}, best fixed {_pct(best.underflow)}.",
        "",
        f"Parameters with the largest share of GS's squared error. GS scale: log2 of the scale the layer's "
        f"weight gradient carries (the best fixed scale: {best_log2} everywhere); model underflow: GS's "
        f"estimate for the gradient the layer sends on; zeroed: nonzero fp32 elements that are zero.",
        "",
        "| parameter | GS share | GS error | GS zeroed | GS scale | model underflow | fixed error | fixed zeroed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ranked = sorted(gs.parameters, key=lambda p: p.share if math.isfinite(p.share) else math.inf, reverse=True)
    for param in ranked[:top]:
        layer, fixed = layers.get(_module(param.name)), best_params[param.name]
        lines.append(
            f"| {param.name} | {_pct(param.share)} | {_fmt(param.error)} | {_pct(param.underflow)} "
            f"| {'' if layer is None else layer.log2_total} | {'' if layer is None else f'{layer.underflow_rate:.2g}'} "
            f"| {_fmt(fixed.error)} | {_pct(fixed.underflow)} |"
        )
    lines += [
        "",
        "Activation gradients that underflow most under GS:",
        "",
        "| module output | GS zeroed | fixed zeroed |",
        "|---|---|---|",
    ]
    for name, rate in sorted(gs.activations.items(), key=lambda item: item[1], reverse=True)[:top]:
        lines.append(f"| {name} | {_pct(rate)} | {_pct(best.activations.get(name, 0.0))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(DEFAULT_MODELS))
    parser.add_argument("--size", choices=SIZES, help="default: realistic on cuda, small on cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warmup-steps", type=int, help="fp32 SGD steps before measuring (default: 20 on cuda, 0 on cpu)"
    )
    parser.add_argument("--details", action="store_true", help="per-layer breakdown for every model")
    parser.add_argument("--json", metavar="FILE", help="write the settings and the table's rows here as JSON")
    args = parser.parse_args()
    size = args.size or ("realistic" if args.device == "cuda" else "small")
    warmup_steps = args.warmup_steps if args.warmup_steps is not None else (20 if args.device == "cuda" else 0)
    device = torch.device(args.device)

    started = time.perf_counter()
    results = []
    for name in args.models:
        result = measure(build(name, size, device, args.seed), warmup_steps, args.seed)
        # Progress, and what is measured so far should a later model not finish.
        summary = ", ".join(f"{row.method}: {_fmt(row.fidelity.error)}" for row in result.rows)
        print(f"{result.workload.title} ({result.seconds:.0f} s): {summary}", file=sys.stderr, flush=True)
        results.append(result)
    elapsed = time.perf_counter() - started

    print(f"Command: python {shlex.join(sys.argv)}\n")
    print(
        f"Settings: {size} size on {args.device} ({_device_name(device)}), torch {torch.__version__}, "
        f"seed {args.seed}, {warmup_steps} fp32 warm-up SGD steps (momentum 0.9) before measuring; "
        f"fixed scales 2^{FIXED_EXPONENTS[0]}..2^{FIXED_EXPONENTS[-1]} (stopping at the first overflow); "
        f"GS: GradientScaler defaults (underflow_rate 1e-3) on its first iteration with finite gradients "
        f"(an update iteration; overflowing ones are skipped and backed off as GradientScaler.step does); "
        f"reference: fp32 with TF32 off. Took {elapsed:.0f} s.\n"
    )
    for result in results:
        warm = (
            ""
            if result.warmup_loss is None
            else f", lr {result.workload.lr:g}, last warm-up loss {result.warmup_loss:.3g}"
        )
        print(f"- {result.workload.title}: {result.workload.settings}{warm}, {result.seconds:.0f} s")
    print()
    print(table([row for result in results for row in result.rows]))
    print(f"\nTarget: GS (default) error <= {TARGET_RATIO}x the best fixed scale's error.\n")
    for result in results:
        skipped = len(result.runs[DEFAULT_GS].attempts) - 1
        note = f" (after {skipped} skipped steps: its first iteration overflowed)" if skipped else ""
        print(
            f"- {result.workload.title}: {_fmt(result.ratio)}x, "
            f"{'met' if result.ratio <= TARGET_RATIO else 'MISSED'}{note}"
        )
    for result in results:
        if args.details or result.ratio > TARGET_RATIO or len(result.runs[DEFAULT_GS].attempts) > 1:
            print("\n" + diagnosis(result))
    if args.json:
        settings = {
            "size": size,
            "device": args.device,
            "device name": _device_name(device),
            "seed": args.seed,
            "fp32 warm-up steps": warmup_steps,
            "torch": torch.__version__,
            "target ratio": TARGET_RATIO,
        }
        rows = [
            {
                "model": row.model,
                "method": row.method,
                "scale": row.scale,
                "gradient error": row.fidelity.error,
                "underflow": row.fidelity.underflow,
                "GS error / best fixed": row.ratio,
            }
            for result in results
            for row in result.rows
        ]
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=1)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


if __name__ == "__main__":
    main()
