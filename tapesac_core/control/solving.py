"""Solving a token bucket's plan for the controller: every rank gives the budget the smallest of
them can, rank 0 solves (``solve_plan``) from the region profiles (calibrated on CPU), the modelled
must-only step and torch's checkpoint as measured steps price it, and the link to host memory
(measured at its first solve on an accelerator) prices offloading; every rank takes its plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ..measure.link import measure_link
from ..measure.memory import physical_memory
from ..plan.offload_choice import Link
from ..plan.plan import Plan
from ..units import format_bytes
from .budget import MemoryBudget
from .measured_times import StepTimes
from .memory_model import MemoryModel
from .plan_cache import ModelKey, solved_for
from .profiling import Profiling
from .ranks import RankAgreement
from .repricing import TorchCheckpointPricing
from .solve import solve_plan
from .step_report import Bucket
from .token_buckets import TokenBuckets

NO_HOST_MEMORY = "plans never offload here: training on the CPU, there is no separate host memory"


class BucketSolver:
    """Solves buckets' plans and predicts their peaks from a run's profiles, step times and token
    buckets; the memory model and the budget (whose config solving reads) are those of the moment,
    given to each call (a resumed run or a new limit replaces them)."""

    def __init__(
        self,
        profiling: Profiling,
        times: StepTimes,
        buckets: TokenBuckets,
        ranks: RankAgreement,
        pricing: TorchCheckpointPricing,
        model_key: ModelKey,
        device: torch.device,
    ) -> None:
        self.profiling = profiling
        self.times = times
        self.buckets = buckets
        self.ranks = ranks
        self.pricing = pricing
        self.model_key = model_key
        self.device = device
        self.on_cpu = device.type == "cpu"
        # Measured at the first solve (``measure_link``, with the host memory offloading may
        # take); None on CPU, where nothing offloads.
        self.link: Link | None = None
        self.host_room: int | None = None

    def plan(
        self,
        key: Bucket,
        edges: dict[str, int],
        memory: MemoryModel,
        budget: MemoryBudget,
        previous: Plan | None = None,
    ) -> Plan:
        """Bucket ``key``'s plan at token counts ``edges``, the same on every rank: rank 0 solves
        (``solve``) with the smallest budget any rank has; ``previous``, the bucket's plan until
        it was to be solved again, is kept where a change would not clearly gain."""
        base = memory.base(self.buckets.primary(edges))
        agreed = self.ranks.smallest(budget.capacity(memory) - base)
        plan = self.ranks.plan_of_rank_0(
            lambda: self.solve(edges, agreed + base, base, key, memory, budget, previous),
            self.model_key,
        )
        self.pricing.priced(key)
        return plan

    def solve(
        self,
        edges: dict[str, int],
        capacity: int,
        base: int,
        key: Bucket,
        memory: MemoryModel,
        budget: MemoryBudget,
        previous: Plan | None = None,
    ) -> Plan:
        """What rank 0 runs: bucket ``key``'s plan at token counts ``edges`` within ``capacity``,
        from a must-only step peak of ``base`` (``previous``: see ``plan``)."""
        if self.on_cpu:
            self.profiling.calibrate(edges)
        if self.link is None and not self.on_cpu:
            self.link = measure_link(self.device)
            self.host_room = budget.config.parsed_offload_host_limit.of(physical_memory()[1])
        plan = self._solved(key, edges, capacity, base, memory, budget, previous, self.link)
        # Under the peak-aware model a must-only peak above the capacity is not the end: saving
        # removes replay temporaries, so only a plan predicted above it means nothing fits.
        if plan.predicted_peak > capacity:
            budget.say_unfit(plan, capacity, edges, memory, self.link)
        notes = (
            self.pricing.note(key),
            budget.near_limit_note(memory),
            NO_HOST_MEMORY if self.link is None and self.on_cpu else None,
        )
        return replace(plan, notes=(*plan.notes, *(n for n in notes if n is not None)))

    def at_capacity(
        self, key: Bucket, capacity: int, memory: MemoryModel, budget: MemoryBudget, link: bool
    ) -> Plan:
        """Bucket ``key``'s best plan at ``capacity`` (``link``: offloading over the measured
        link), nothing said or kept: a point of its frontier, for plots."""
        edges = self.buckets.edges(key)
        base = memory.base(self.buckets.primary(edges))
        over = self.link if link else None
        return self._solved(key, edges, capacity, base, memory, budget, None, over)

    def _solved(
        self,
        key: Bucket,
        edges: dict[str, int],
        capacity: int,
        base: int,
        memory: MemoryModel,
        budget: MemoryBudget,
        previous: Plan | None,
        link: Link | None,
    ) -> Plan:
        """``solve_plan`` on the bucket's profiles, times and memory timeline."""
        profiles = self.profiling.of(edges)
        must_only_seconds = self.must_only_seconds(key, edges)
        return solve_plan(
            profiles,
            edges,
            model=self.model_key.regions,
            capacity=capacity,
            base=base,
            must_only_step_time=must_only_seconds,
            config=budget.config,
            timeline=memory.timeline(self.buckets.primary(edges)),
            torch_checkpoint_gains=self.pricing.gains(key, profiles, edges, must_only_seconds),
            previous=previous,
            link=link,
            host_room=self.host_room,
        )

    def must_only_seconds(self, key: Bucket, edges: dict[str, int]) -> float:
        """The modelled must-only step seconds of bucket ``key`` at ``edges``."""
        return self.times.modelled_must_only(
            key, edges, self.profiling.of(edges), self.buckets.primary
        )

    def peak_at(self, plan: Plan, tokens: Mapping[str, int], memory: MemoryModel) -> int:
        """``plan``'s predicted peak at ``tokens``, with the memory outside the blocks as it was
        when the memory model was sampled (what ``MemoryBudget.capacity`` is compared with)."""
        primary = self.buckets.primary(tokens)
        edges = solved_for(plan)
        # A plan of no region (one a resumed run can hold) adds nothing to scale.
        factor = primary / self.buckets.primary(edges) if edges else 1.0
        return plan.peak_at_tokens(memory.base(primary), factor)

    def fits(
        self, plan: Plan, tokens: Mapping[str, int], memory: MemoryModel, budget: MemoryBudget
    ) -> bool:
        """Whether ``plan`` is predicted to fit a step of ``tokens`` on every rank."""
        # The "sum" memory model predicts no step peak: its plans are solved again.
        fits = bool(plan.predicted_peak) and (
            self.peak_at(plan, tokens, memory) <= budget.capacity(memory)
        )
        return self.ranks.every(fits)

    def full_fits(
        self, key: Bucket, planned: bool, memory: MemoryModel, budget: MemoryBudget
    ) -> bool:
        """Whether bucket ``key`` (``planned``: it has a plan) still measures full checkpointing
        against must-only before its first plan (``torch_checkpoint_blocks``): its peak predicted
        within the limit on every rank."""
        if not self.pricing.measures_full(key, planned):
            return False
        peak, capacity = self.full_step_peak(key, memory), budget.capacity(memory)
        fits = self.ranks.every(peak is not None and peak <= capacity)
        if not fits:
            self.pricing.unmeasured(
                key,
                "the memory model cannot predict a full-checkpointing step's peak (no memory "
                "timeline of blocks matching the profiles)"
                if peak is None
                else f"a full-checkpointing step is predicted at {format_bytes(peak)}, above the "
                f"{format_bytes(capacity)} the limit leaves, so none ran"
                if peak > capacity
                else "another rank predicts a full-checkpointing step above its capacity",
            )
        return fits

    def full_step_peak(self, key: Bucket, memory: MemoryModel) -> int | None:
        """The predicted peak of a full-checkpointing step of bucket ``key`` at its token counts;
        None before profiles and memory samples exist, or where the timeline does not match
        them."""
        if not (self.profiling.profiles and memory.samples):
            return None
        edges = self.buckets.edges(key)
        primary = self.buckets.primary(edges)
        return self.pricing.full_peak(self.profiling.of(edges), edges, memory, primary)
