"""The step's one read: is any gradient non-finite, and what the drift statistic needs, in one synchronisation.

As ``torch.amp.GradScaler`` reads ``found_inf`` once per step, the step reads every ``.grad`` its
optimizer will use, whoever wrote it and however (``.data``, numpy, a kernel: writes no version
counter sees): each one's largest magnitude, non-finite exactly where the gradient is. The weight
gradients the backwards since the last step queued for the drift statistic are among them, read in
the same pass. What that reading asks for follows on the host: an overflowed weight gradient
recomputed in fp32 (:mod:`~gs_lightning.scaling.recompute`), an update of a structure whose
gradients drifted, or the raised expectation of one whose rise stays within its margin.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from gs_lightning.scaling.bounds import expected_total
from gs_lightning.scaling.drift import largest_magnitudes, within_margin
from gs_lightning.scaling.finite import unscale_and_check_
from gs_lightning.scaling.formats import FloatFormat
from gs_lightning.scaling.gradient_stats import DeviceRead
from gs_lightning.scaling.graph_scales import GraphScales
from gs_lightning.scaling.profiled import profiled
from gs_lightning.scaling.recipe import ScalingRecipe
from gs_lightning.scaling.recompute import WeightGradRecompute
from gs_lightning.scaling.schedule import UpdateReason, drift_reasons

# What the follower's shifts take in without an update (ScalingRecipe.follow_gradients): a level that fell.
FOLLOWED = frozenset({UpdateReason.DRIFT})


class StepRead:
    """Reads the gradients at the step and acts on the drift statistic queued since the last one.

    Args:
        recompute: What the replay of the loss's graph kept to recompute weight gradients that overflow.
        fmt: The gradients' format (its λmax; its λmin as the recipe names it).
        recipe: The scaler's recipe (:attr:`ScalingRecipe.expected_maxima_margin_log2` and
            :attr:`ScalingRecipe.expect_surprise_within_margin` are read here); the scaler replaces it
            where a checkpoint's is restored.

    Attributes:
        recompute_graph: The structure whose replay registered :attr:`recompute`'s keepers.
        recomputed_steps: Steps taken although a weight gradient overflowed: it was recomputed in fp32.
    """

    def __init__(self, recompute: WeightGradRecompute, fmt: FloatFormat, recipe: ScalingRecipe) -> None:
        self.recompute = recompute
        self.format = fmt
        self.recipe = recipe
        self.recompute_graph: GraphScales | None = None
        self.recomputed_steps = 0
        self._unread: list[GraphScales] = []

    @property
    def lambda_max(self) -> float:
        """λmax of the gradients' format."""
        return self.format.max

    @property
    def lambda_min(self) -> float:
        """λmin of the underflow model, as the recipe (restored with a checkpoint's too) names it."""
        return self.format.lambda_min(self.recipe.lambda_min)

    def queue(self, graph: GraphScales) -> None:
        """A backward of ``graph`` ended: the next read takes the maxima its drift monitor queued."""
        if graph not in self._unread:
            self._unread.append(graph)

    def discard(self) -> None:
        """The iteration ended: drop what was queued and not read (a step skipped before any read), and what was
        kept."""
        for graph in self._unread:
            graph.drift.discard()
        self._unread = []
        self.recompute.clear()

    def non_finite(self, grads: list[torch.Tensor], sharded: bool) -> bool:
        """Whether one of ``grads`` is non-finite now: one read of each, with the drift statistic, in one sync.

        The first read after a backward also takes the largest magnitudes of the weight gradients it
        queued (:meth:`GradientDrift.pending`: each tensor read once, where it is also one of ``grads``).
        Where that reading finds weight gradients that overflowed by themselves at GEMMs the replay kept
        the operands of, they are recomputed in fp32 into ``.grad`` and ``grads`` are read again; either
        way what the replay kept is released then (no later read recomputes).
        ``sharded``: each rank holds its own shard of ``grads`` (FSDP1): the flag is reduced across ranks.
        In a profiler's trace: ``GradientScaler.step_read``.
        """
        with profiled("GradientScaler.step_read"):
            return self._read_gradients(grads, sharded)

    def _read_gradients(self, grads: list[torch.Tensor], sharded: bool) -> bool:
        """The read :meth:`non_finite` describes."""
        unread = self._unread
        pending = [graph.drift.pending() for graph in unread]
        # A sharded gradient (FSDP2's DTensor): this rank's shard, the flag reduced across ranks below.
        local = [_local(g) for g in grads]
        # The queued weight gradients first, each tensor once.
        queued = [t for tensors in pending for t in tensors]
        dense = list({id(t): t for t in (*queued, *local) if t.is_floating_point() and not t.is_sparse}.values())
        read = DeviceRead()
        read.put("largest magnitudes", [largest_magnitudes(dense)] if dense else [])
        # Sparse gradients' values, coalesced where fp16 duplicates may overflow.
        read.put("sparse flags", unscale_and_check_(g for g in local if g.is_sparse))
        for graph in unread:  # what the updates left on the device: read here, not in their backwards
            graph.put_unread(read)
        tails = {}  # the followed weight gradients' shares of values sunk below λmin, read in the same sync
        for graph in unread if self.recipe.follow_gradients else ():
            shares = graph.follower.tail_shares(graph.drift.queued(), self.lambda_min)
            if shares is not None:
                tails[graph] = shares[0]
                read.put((graph, "tails"), [shares[1]])
        values = read.read()  # one sync
        index = {id(t): k for k, t in enumerate(dense)}
        largest = values["largest magnitudes"]
        maxima = [largest[index[id(t)]] for t in local if id(t) in index]
        non_finite = not all(map(math.isfinite, maxima)) or any(values["sparse flags"])
        if sharded or any(g is not t for g, t in zip(grads, local)):
            # Every rank joins, gradients or not.
            non_finite = any_rank(non_finite, (dense or local or [torch.zeros(())])[0].device)
        if not unread:
            return non_finite
        self._unread = []
        for graph in unread:
            graph.take_reading(values)
        for graph, tensors in zip(unread, pending):  # two graphs may queue one .grad (two losses into one model)
            settled = graph.kept_on_zero_gradient() if graph.drift.reads_update else frozenset()
            graph.drift.read([largest[index[id(t)]] for t in tensors], settled)
        recomputed = self.recompute_graph in unread and self._recompute_overflows(self.recompute_graph)
        # No later read recomputes: what the replay kept (GEMM inputs and incoming gradients) goes now,
        # before the optimizer steps, not at update().
        self.recompute.clear()
        for graph in unread:
            # a fall the follower's shifts take in asks for no update
            shares = dict(zip(tails[graph], values[graph, "tails"])) if graph in tails else {}
            followed = self.recipe.follow_gradients and self._follow(graph, shares)
            reasons = drift_reasons(graph.drift.last) - (FOLLOWED if followed else frozenset())
            if reasons and not self._surprise_within_margin(graph, followed):
                graph.schedule.ask(*reasons)
        return self._read_gradients(grads, sharded) if recomputed else non_finite

    def _follow(self, graph: GraphScales, tails: dict[int, float]) -> bool:
        """Raise the GEMMs' scales of ``graph`` as its weight gradients' levels fall
        (:mod:`~gs_lightning.scaling.follow`): an update's reading becomes the follower's reference, a later one
        may shift the plan the next backwards replay. Whether the structure follows (a skipped step stops it
        until the next update)."""
        follower, reading, recipe = graph.follower, graph.drift.last, self.recipe
        plan, analysis = graph.plans.get(()), graph.analyses.get(())
        if not follower.eligible or plan is None or analysis is None:
            return False
        if reading.non_finite:
            follower.forget()
            return False
        if reading.update:
            layers = graph.layers  # the update's, read with this step's values
            follower.rebase(
                plan,
                analysis,
                graph.drift.recent,
                graph.drift.expected,
                recipe.level_steps,
                recipe.recomputed_spike_share if recipe.recompute_weight_gradients else 1.0,
                {g: layers[name].limit for g, name in analysis.layer_names.items() if name in layers},
            )
            return True
        margin = recipe.expected_maxima_margin_log2 or 0.0

        def highest_total(log2_value: float) -> int:  # the update's bound on parameter gradients, within the cap
            return min(expected_total(2.0**log2_value, self.lambda_max, margin), recipe.max_log2_total_scale)

        shifted = follower.follow(
            graph.drift.recent,
            recipe.level_steps,
            highest_total,
            graph.layer_backoff.node_caps(),
            analysis,
            recipe.kept_downstream_cap,
            recipe.drift_tolerance_log2,
            tails,
            recipe.underflow_rate,
        )
        if shifted is not None:
            graph.plans[()] = shifted
        if follower.unfollowed:
            graph.schedule.ask(UpdateReason.DRIFT)
        return follower.base is not None

    def _surprise_within_margin(self, graph: GraphScales, followed: bool) -> bool:
        """Where weight gradients rising above what the last update expected of them is all that asks for an
        update, and each is computed at a scale an update expecting it would allow: expect those values from now
        on, without an update. Whether it did.

        A gradient's scale allows it where the follower bounded its GEMMs by it this step (``followed``:
        :meth:`LevelFollower.bounds <gs_lightning.scaling.follow.LevelFollower.bounds>`, lowering them where it
        had to), or where the margin above expected maxima is intact
        (:func:`~gs_lightning.scaling.drift.within_margin`;
        :attr:`ScalingRecipe.expect_surprise_within_margin`): the update such a rise asked for before would not
        lower those layers on its account (SegNet's updates were 40 of 47 of these, 0.01-0.62 binades above what
        was expected).
        """
        reading, margin_log2 = graph.drift.last, self.recipe.expected_maxima_margin_log2
        if margin_log2 is None:
            return False
        plan, analysis = graph.plans.get(()), graph.analyses.get(())
        shrank = reading.shrank and not followed  # a shrink the follower took in asks for nothing
        if not reading.surprised or reading.non_finite or shrank or plan is None or analysis is None:
            return False
        unbounded = {j: v for j, v in reading.surprised.items() if not (followed and graph.follower.bounds(j))}
        if unbounded:
            highest_total = partial(expected_total, lambda_max=self.lambda_max, margin_log2=margin_log2)
            if not self.recipe.expect_surprise_within_margin or not within_margin(
                analysis, plan, unbounded, highest_total
            ):
                return False
        graph.drift.raise_expected(reading.surprised)
        return True

    def _recompute_overflows(self, graph: GraphScales) -> bool:
        """Where every non-finite gradient is a weight gradient that overflowed by itself at a GEMM the replay
        kept the operands of, recompute those in fp32 into ``.grad``; whether it did (the step can go on)."""
        reading = graph.drift.last
        if not reading.non_finite:
            return False
        with profiled("GradientScaler.recompute"):
            grads = self.recompute.recompute(reading.non_finite)
        if grads is None:
            return False
        for parameter, grad in grads.values():
            parameter.grad.copy_(grad)
        maxima = largest_magnitudes([grad for _, grad in grads.values()]).tolist()
        graph.drift.recomputed(dict(zip(grads, maxima)))
        self.recomputed_steps += 1
        return True


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient's shard on this rank; any other gradient as it is."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank (sharded gradients: each rank checked its own shard). One reduction where
    a process group is initialised, which every rank calls."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    reduced = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
    return bool(reduced.item())
