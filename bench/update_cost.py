"""What a GradientScaler update iteration costs against a plain backward, on a third-party model zoo (issue 19).

For every model of ``bench/_zoo.py`` (torchvision classifiers, timm, Hugging Face transformers
from small configs, packed RNNs; timm and transformers only if installed), in fp32 on one CPU
thread (``--threads``, or on ``--device``), methods interleaved round by round on the same batch,
medians of the rounds:

* plain   ``loss.backward()``
* update  ``GradientScaler.backward`` + ``found_inf`` on an update iteration (statistics, probes)
* replay  ``GradientScaler.backward`` + ``found_inf`` between updates (constant factors)

Only the backward and the finiteness check are timed (the forward is the same for all). Every
model is also checked for bit-exactness: each ``.grad`` after an update and after a replay
iteration must equal plain backward's (``torch.equal``), except where two plain backwards differ
(a parallel ``index_put_`` with several CPU threads accumulates in no fixed order): those
parameters are counted as nondeterministic, not compared. Prints a row per model and the median
ratio per family.

    pip install --target /tmp/zoo_pkgs timm transformers                 # optional, not a project dependency
    PYTHONPATH=$PWD:/tmp/zoo_pkgs python bench/update_cost.py            # default zoo, a few minutes
    python bench/update_cost.py --all --families torchvision             # every list_models() classifier
    python bench/update_cost.py --models resnet18 gpt2 --dump-layers layers.json
    python bench/update_cost.py --rounds 1 --json zoo.json                # also the settings and rows as JSON
    python bench/update_cost.py --batch-scale 8                          # 8x the batches: fixed costs weigh less
    # ImageNet's images, batch 8; BERT-base's width, batch 8; both on a GPU:
    python bench/update_cost.py --families torchvision timm --image-size 224 --batch-scale 4 --threads 2
    python bench/update_cost.py --families transformers --transformer-width 768 --batch-scale 4
    python bench/update_cost.py --device cuda --families torchvision transformers --image-size 224 \
        --transformer-width 768 --batch-scale 16
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from _zoo import FAMILIES, ZooModel, zoo
from torch import nn

from gs_lightning import GradientScaler

METHODS = ("plain", "update", "replay")


@dataclass
class Measurement:
    """One model's medians (ms), exactness, and the decisions of its update.

    ``error`` is set (and the rest empty) when the model could not be built or run;
    ``nondeterministic`` counts the parameters whose gradients two plain backwards computed differently.
    """

    family: str
    name: str
    times: dict[str, float] = field(default_factory=dict)
    exact_update: bool = False
    exact_replay: bool = False
    nondeterministic: int = 0
    layers: list[dict] = field(default_factory=list)
    error: str = ""

    def ratio(self, method: str) -> float:
        return self.times[method] / self.times["plain"] if self.times else math.nan


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))


def _equal(a: list[torch.Tensor | None], b: list[torch.Tensor | None], skip: frozenset[int] = frozenset()) -> bool:
    return len(a) == len(b) and all(_same(x, y) for k, (x, y) in enumerate(zip(a, b)) if k not in skip)


def _scaled_backward(scaler: GradientScaler, loss: torch.Tensor) -> None:
    scaler.backward(loss)
    scaler.found_inf  # noqa: B018 - the step's finiteness check
    scaler.update()


def measure(
    entry: ZooModel, rounds: int, batch_scale: int = 1, warmup: int = 1, device: torch.device | str = "cpu"
) -> Measurement:
    """Time plain, update and replay backwards of one zoo model on ``device`` and check their gradients are equal."""
    result = Measurement(entry.family, entry.name)
    try:
        torch.manual_seed(0)
        model, forward = entry.build(batch_scale, device)
        synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
        update = GradientScaler(model, update_interval=1)
        replay = GradientScaler(model, update_interval=10**9)
        backward: dict[str, Callable[[torch.Tensor], None]] = {
            "plain": lambda loss: loss.backward(),
            "update": lambda loss: _scaled_backward(update, loss),
            "replay": lambda loss: _scaled_backward(replay, loss),
        }

        def run(method: str) -> float:
            model.zero_grad(set_to_none=True)
            torch.manual_seed(0)  # the same dropout masks for every method
            loss = forward()
            synchronize()  # the forward's kernels are not the backward's time
            start = time.perf_counter()
            backward[method](loss)
            synchronize()
            return (time.perf_counter() - start) * 1e3

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # opaque-node and statistics warnings: the exactness column tells
            run("replay")  # its one update; every later backward replays it
            grads = {}
            for method in METHODS:
                run(method)
                grads[method] = _grads(model)
            run("plain")
            again = _grads(model)
            unstable = frozenset(k for k, (x, y) in enumerate(zip(grads["plain"], again)) if not _same(x, y))
            result.nondeterministic = len(unstable)
            result.exact_update = _equal(grads["plain"], grads["update"], unstable)
            result.exact_replay = _equal(grads["plain"], grads["replay"], unstable)
            result.layers = [layer.state_dict() for layer in update.layers()]
            samples: dict[str, list[float]] = {m: [] for m in METHODS}
            for round_ in range(warmup + rounds):
                for method in METHODS:
                    elapsed = run(method)
                    if round_ >= warmup:
                        samples[method].append(elapsed)
        result.times = {m: statistics.median(s) for m, s in samples.items()}
    except Exception as error:  # noqa: BLE001 - a model that fails is a row of the table, not the end of the run
        result.error = f"{type(error).__name__}: {error}".splitlines()[0][:160]
        traceback.print_exc()
    return result


def report(results: list[Measurement]) -> str:
    """The per-model table and the per-family medians, as Markdown."""
    lines = [
        "| family | model | plain ms | update ms | replay ms | update / plain | replay / plain | decisions "
        "| exact (update, replay) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.family} | {r.name} | | | | | | | failed: {r.error} |")
            continue
        exact = (
            "yes"
            if r.exact_update and r.exact_replay
            else f"NO ({'yes' if r.exact_update else 'no'}, {'yes' if r.exact_replay else 'no'})"
        )
        if r.nondeterministic:
            exact += f" ({r.nondeterministic} nondeterministic in plain backward)"
        lines.append(
            f"| {r.family} | {r.name} | {r.times['plain']:.1f} | {r.times['update']:.1f} | {r.times['replay']:.1f} "
            f"| {r.ratio('update'):.2f} | {r.ratio('replay'):.2f} | {len(r.layers)} | {exact} |"
        )
    lines += [
        "",
        "| family | models | median update / plain | median replay / plain | bit-exact | failed |",
        "|---|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        rows = [r for r in results if r.family == family]
        ok = [r for r in rows if not r.error]
        if not rows:
            continue
        median = lambda method: f"{statistics.median(r.ratio(method) for r in ok):.2f}" if ok else "-"  # noqa: E731
        exact = sum(r.exact_update and r.exact_replay for r in ok)
        lines.append(
            f"| {family} | {len(rows)} | {median('update')} | {median('replay')} | {exact} of {len(ok)} "
            f"| {len(rows) - len(ok)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Measurement]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--models", nargs="+", default=[], help="only these models (names as in the table)")
    parser.add_argument("--all", action="store_true", help="every torchvision list_models() classifier, at 64x64")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per model (after one warm-up round)")
    parser.add_argument(
        "--batch-scale", type=int, default=1, help="multiply every model's batch (bench/_zoo.py) by this"
    )
    parser.add_argument(
        "--image-size", type=int, help="torchvision and timm images at this size (default 32, 64 with --all)"
    )
    parser.add_argument(
        "--transformer-width", type=int, default=128, help="width of the transformers family (default 128)"
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--device", default="cpu", help="where the models run, e.g. cuda (default cpu)")
    parser.add_argument(
        "--dump-layers", metavar="FILE", help="write every model's scaler.layers() of its update as JSON"
    )
    parser.add_argument(
        "--json", metavar="FILE", help="write the settings and every model's times and exactness as JSON"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.batch_scale < 1:
        parser.error(f"--rounds and --batch-scale must be at least 1, got {args.rounds} and {args.batch_scale}")
    if args.image_size is not None and args.image_size < 32:
        parser.error(f"--image-size must be at least 32 (the zoo's smallest), got {args.image_size}")
    if args.transformer_width < 64 or args.transformer_width % 64:
        parser.error(
            f"--transformer-width must be a positive multiple of 64 (heads of up to 64 features), "
            f"got {args.transformer_width}"
        )

    torch.set_num_threads(args.threads)
    models = zoo(
        tuple(args.families),
        every_torchvision=args.all,
        names=tuple(args.models),
        image_size=args.image_size,
        transformer_width=args.transformer_width,
    )
    if not models:
        parser.error(
            f"no zoo model matches --families {args.families} --models {args.models} (timm/transformers installed?)"
        )
    results = []
    for entry in models:
        start = time.perf_counter()
        results.append(measure(entry, args.rounds, args.batch_scale, device=args.device))
        print(f"{entry.family}/{entry.name}: {time.perf_counter() - start:.1f} s", flush=True)
    images = f", images {args.image_size}x{args.image_size}" if args.image_size else ""
    images += f", transformers of width {args.transformer_width}" if args.transformer_width != 128 else ""
    where = (
        f"{args.threads} CPU thread(s)"
        if torch.device(args.device).type == "cpu"
        else f"{args.device} ({torch.cuda.get_device_name(args.device)})"
    )
    print(
        f"\nfp32, {where}, batch x{args.batch_scale}{images}, median of {args.rounds} interleaved rounds; "
        f"torch {torch.__version__}\n"
    )
    print(report(results))
    if args.dump_layers:
        with open(args.dump_layers, "w") as f:
            json.dump({f"{r.family}/{r.name}": r.layers for r in results}, f, indent=1)
    if args.json:
        settings = {
            "families": args.families,
            "rounds": args.rounds,
            "batch scale": args.batch_scale,
            "image size": args.image_size or (64 if args.all else 32),
            "transformer width": args.transformer_width,
            "where": where,
            "torch": torch.__version__,
        }
        rows = [{**{k: v for k, v in asdict(r).items() if k != "layers"}, "decisions": len(r.layers)} for r in results]
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
