"""Token counts per region type and the buckets they fall in (paper §3.4.4): one plan per bucket,
solved for the most tokens seen in the bucket so far (its upper edge before any was seen)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..config import TapeSACConfig
from ..errors import TapeSACError
from ..plan import bucket, upper_edge
from .step_report import Bucket

ALL = "*"  # in a tokens mapping: the count of every region type not named


class TokenBuckets:
    """Reads a step's token counts and names its bucket. Secondary regions (``secondary_regions``)
    take the largest count seen so far, so their share of a plan never shrinks back."""

    def __init__(self, regions: Sequence[str], config: TapeSACConfig) -> None:
        self.regions = list(regions)
        self.config = config
        self._secondary_max: dict[str, int] = {}
        self._seen: dict[Bucket, dict[str, int]] = {}  # per bucket, the most tokens per region

    def per_region(self, tokens: int | Mapping[str, int]) -> dict[str, int]:
        """Every region's count from an int (all regions) or a mapping (``"*"``: the rest)."""
        if isinstance(tokens, Mapping):
            unknown = set(tokens) - set(self.regions) - {ALL}
            if unknown:
                raise TapeSACError(
                    f"tokens name unknown region types {sorted(unknown)}; the "
                    f"model's are {self.regions}"
                )
            default = tokens.get(ALL)
            given = {r: tokens.get(r, default) for r in self.regions}
            missing = [r for r, n in given.items() if n is None]
            if missing:
                raise TapeSACError(f"tokens miss region types {missing}: give every region's count")
            per = {r: int(n) for r, n in given.items() if n is not None}
        else:
            per = {r: int(tokens) for r in self.regions}
        if any(n < 1 for n in per.values()):
            raise TapeSACError(f"token counts must be >= 1, got {per}")
        return per

    def primary(self, tokens: Mapping[str, int]) -> int:
        """The count memory scales with: the largest of the primary regions'."""
        primary = [n for r, n in tokens.items() if r not in self.config.secondary_regions]
        return max(primary or tokens.values())

    def key(self, tokens: Mapping[str, int]) -> Bucket:
        """The bucket of ``tokens``; a secondary region's count raises its largest so far."""
        key = []
        for r in self.regions:
            if self._secondary(r):
                self._secondary_max[r] = max(self._secondary_max.get(r, 0), tokens[r])
                key.append(bucket(self._secondary_max[r], self._factor(r)))
            else:
                key.append(bucket(tokens[r], self._factor(r)))
        return tuple(key)

    def see(self, key: Bucket, tokens: Mapping[str, int]) -> bool:
        """Count ``tokens`` (a step's, agreed by every rank) in bucket ``key``; whether they are
        more than the bucket has seen before in some region (False at the bucket's first count).
        A secondary region counts its largest so far, as its bucket does."""
        counts = {
            r: self._secondary_max.get(r, tokens[r]) if self._secondary(r) else tokens[r]
            for r in self.regions
        }
        seen = self._seen.get(key)
        if seen is None:
            self._seen[key] = counts
            return False
        grown = any(n > seen[r] for r, n in counts.items())
        self._seen[key] = {r: max(n, seen[r]) for r, n in counts.items()}
        return grown

    def edges(self, key: Bucket) -> dict[str, int]:
        """Per region, the token counts bucket ``key``'s plan is solved for: the most seen in it so
        far, or its upper edge (no count in the bucket exceeds it) before any was seen."""
        if key in self._seen:
            return dict(self._seen[key])
        return {r: upper_edge(q, self._factor(r)) for r, q in zip(self.regions, key)}

    def restore(self, key: Bucket, tokens: Mapping[str, int]) -> None:
        """A resumed run's bucket ``key`` has seen ``tokens`` (those its restored plan was solved
        for)."""
        self._seen[key] = {r: int(tokens[r]) for r in self.regions}

    def _secondary(self, region: str) -> bool:
        return region in self.config.secondary_regions

    def _factor(self, region: str) -> float:
        if self._secondary(region):
            return self.config.secondary_bucket_factor
        return self.config.primary_bucket_factor
