"""From region profiles and a byte budget to a Plan (Algorithm 1, lines 3-7)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from .config import TapeSACConfig
from .plan import Point, RegionFrontier, replay_time, solve_knapsack
from .plan.plan import Plan, RegionPlan, Saved
from .plan.tape_graph import name_coord
from .profile import RegionProfile
from .step_time import StepTime


def scaled(points: tuple[Point, ...], factor: float,
           bytes_at: Callable[[Point, float], int] | None = None) -> tuple[Point, ...]:
    """A frontier at another token count: times scale linearly with tokens (§3.4.1), and so do
    sizes, or as ``bytes_at`` says (values that do not grow with tokens stay). Points another
    one now dominates are dropped, so the result is again a frontier."""
    size = bytes_at or (lambda p, f: math.ceil(p.bytes * f))
    moved = sorted((Point(bytes=size(p, factor), time=p.time * factor, saved=p.saved)
                    for p in points), key=lambda p: (p.bytes, p.time))
    frontier: list[Point] = []
    for p in moved:
        if not frontier or p.time < frontier[-1].time and p.bytes > frontier[-1].bytes:
            frontier.append(p)
    return tuple(frontier)


def modelled_replay(profiles: Mapping[str, RegionProfile], tokens: Mapping[str, int]) -> float:
    """Seconds of must-only replay in a step at ``tokens``, from the profiled node times (Eq. 6
    for S0, every block of each region, times scaled linearly with tokens)."""
    return math.fsum(p.blocks * p.must_only_replay_time * tokens[r] / p.tokens
                     for r, p in profiles.items() if r in tokens)


def solve_plan(profiles: Mapping[str, RegionProfile], tokens: Mapping[str, int], *, model: str,
               capacity: int, base: int, must_only_step_time: float,
               config: TapeSACConfig) -> Plan:
    """The plan maximising replay time removed with Σ bytes ≤ capacity − base (Eqs. 8-9).

    Its predicted speedup comes from ``StepTime``: ``must_only_step_time`` minus the modelled
    must-only replay is the time outside replay (floored, see ``StepTime.model``), so the
    prediction is finite and at most must-only / outside, whatever the profiled times were.
    """
    frontiers = {r: scaled(p.frontier(config.beam_width, config.max_set_size), tokens[r] / p.tokens,
                           p.bytes_at) for r, p in profiles.items()}
    budget = capacity - base
    choice = solve_knapsack(
        {r: RegionFrontier(points=f, blocks=profiles[r].blocks) for r, f in frontiers.items()},
        budget, resolution=config.knapsack_resolution)
    regions = {r: _region_plan(profiles[r], frontiers[r], choice.choices[r], tokens[r])
               for r in sorted(profiles)}
    gain = choice.gain
    full = sum(p.blocks * (p.full_recompute_time - p.must_only_replay_time) * tokens[r] / p.tokens
               for r, p in profiles.items())
    step = StepTime.of_step(must_only_step_time, modelled_replay(profiles, tokens))
    planned_time = step.planned(gain)
    notes = () if budget > 0 else (
        f"the must-only step needs {base} bytes of the {capacity} the limit leaves: nothing "
        "more is saved",)
    return Plan(model=model, regions=regions, capacity=capacity, base=base,
                saved_bytes=choice.bytes, predicted_speedup=step.speedup(gain),
                predicted_speedup_vs_full=(step.must_only + max(0.0, full)) / planned_time, notes=notes,
                step_time=step.must_only, replay_time=step.replay)


def _region_plan(profile: RegionProfile, points: tuple[Point, ...], chosen: tuple[int, ...],
                 tokens: int) -> RegionPlan:
    tape = profile.tape
    blocks = tuple(frozenset(name_coord(n) for n in points[i].saved) for i in chosen)
    anchors = tuple(frozenset(tape.anchor(tape.find(c)) for c in b) for b in blocks)
    modules = {m: tape.module_fingerprints[m] for b in anchors for m, *_ in b}
    others = len(blocks) - sum(profile.shares_reference)
    note = (f"{others} of {len(blocks)} blocks ran another op sequence (data-dependent control "
            "flow): they save what the plan names in submodules whose ops match the reference "
            "block's (anchored coordinates)" if others else "")
    largest = points[max(chosen)] if chosen else points[0]
    return RegionPlan(sequence=profile.sequence, blocks=blocks, tokens=tokens,
                      saved=_describe(profile, largest, tokens / profile.tokens), note=note,
                      block_bytes=tuple(points[i].bytes for i in chosen), anchors=anchors,
                      modules=modules)


def _describe(profile: RegionProfile, point: Point, factor: float) -> tuple[Saved, ...]:
    """Each value of a save set: bytes, and replay time it removes given the rest of the set."""
    graph, tape = profile.graph, profile.tape
    saved = graph.value_ids(point.saved)
    whole = replay_time(graph, saved)
    rows = []
    for vid in sorted(saved):
        coord = name_coord(graph.value_names[vid])
        node = tape.nodes[tape.values[vid].node]
        grows = vid not in tape.token_independent
        rows.append(Saved(coord=coord, module=node.module,
                          bytes=math.ceil(tape.bytes_of([vid]) * (factor if grows else 1)),
                          time_removed=(replay_time(graph, saved - {vid}) - whole) * factor))
    return tuple(rows)
