"""The region profiles a run collects (paper §3.4.1): ``profile_steps`` timed steps merged into
one reference block per region type, calibrated before each solve against the replays that plain
must-only steps measured."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container, Iterable, Mapping, Sequence

from ..tape.block import BlockTrace
from .profile import (
    RegionProfile,
    ReplayWall,
    calibrated,
    merged,
    region_profiles,
    with_forward_paths,
)

_WALLS = 64  # recent must-only block replays per region that profiled times are checked against


class Profiling:
    """Profiles per region type, and how far a run of ``steps`` profiling steps has come."""

    def __init__(self, steps: int, tolerance: float) -> None:
        self.steps, self.tolerance = steps, tolerance
        self.profiles: dict[str, RegionProfile] = {}
        self.done = 0  # profiling steps taken in the current run of them
        self.walls = ReplayWalls()

    def take(self, blocks: list[BlockTrace], tokens: Mapping[str, int]) -> bool:
        """One profiling step's blocks, merged in; whether the run is complete (a new reference
        block: every plan must be solved again)."""
        fresh = region_profiles(blocks, tokens)
        self.profiles = {r: merged(self.profiles.get(r), p) for r, p in fresh.items()}
        self.done += 1
        if self.done < self.steps:
            return False
        self.done = 0
        return True

    def held_inputs_less(self, blocks: Iterable[BlockTrace], tokens: Mapping[str, int]) -> bool:
        """Whether some block of a step (at ``tokens``) alone held fewer bytes of its inputs when
        the next block started than its region's profile counts on (its caller kept them
        longer: offloading took less off the device than planned); such a profile now counts
        on that block's bytes, and every plan must be solved again."""
        less = False
        for b in blocks:
            region, position = b.tape.region, b.position
            p = self.profiles.get(region)
            if p is None or b.inputs_alone is None or position >= len(p.inputs_alone):
                continue
            measured = math.floor(b.inputs_alone * p.tokens / tokens[region])
            if measured < p.inputs_alone[position]:
                alone = list(p.inputs_alone)
                alone[position] = measured
                self.profiles[region] = dataclasses.replace(p, inputs_alone=tuple(alone))
                less = True
        return less

    def outgrown(self, tokens: Mapping[str, int], factor: float) -> bool:
        """Whether some region's count in ``tokens`` exceeds ``factor`` times its reference
        block's: its profile is taken again."""
        return any(tokens[r] > factor * p.tokens for r, p in self.profiles.items())

    def of(self, regions: Container[str]) -> dict[str, RegionProfile]:
        """The profiles taken of ``regions`` (a bucket's: the keys of its token counts)."""
        return {r: p for r, p in self.profiles.items() if r in regions}

    def calibrate(self, regions: Iterable[str]) -> None:
        """Each region's node times checked against measured replay wall times (host times: on
        accelerators they would measure launches, not kernels, so call it on CPU only)."""
        for r in regions:
            if r in self.profiles:
                profile = calibrated(self.profiles[r], self.walls.of(r), self.tolerance)
                self.profiles[r] = with_forward_paths(profile, self.walls.of(r))


class ReplayWalls:
    """Each region's recent blocks in plain must-only steps (not timed per op, not metered:
    both slow the step down): their replays, the measure profiled node times are checked
    against, and their forwards' paths and wall times (``with_forward_paths``)."""

    def __init__(self) -> None:
        self._walls: dict[str, list[ReplayWall]] = {}

    def add(self, blocks: Iterable[BlockTrace], tokens: Mapping[str, int]) -> None:
        for b in blocks:
            walls = self._walls.setdefault(b.tape.region, [])
            walls.append(
                ReplayWall(
                    sequence=b.tape.fingerprint,
                    replayed=tuple(b.replayed),
                    seconds=b.replay_seconds,
                    tokens=tokens[b.tape.region],
                    steady=b.steady,
                    forward_seconds=b.forward_seconds,
                )
            )
            del walls[:-_WALLS]

    def of(self, region: str) -> Sequence[ReplayWall]:
        return self._walls.get(region, ())
