"""Token counts per region type and the buckets they fall in (paper §3.4.4): one plan per bucket,
solved at the bucket's upper edge."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .config import TapeSACConfig
from .errors import TapeSACError
from .plan import bucket, upper_edge
from .step_report import Bucket

ALL = "*"  # in a tokens mapping: the count of every region type not named


class TokenBuckets:
    """Reads a step's token counts and names its bucket. Secondary regions (``secondary_regions``)
    take the largest count seen so far, so their share of a plan never shrinks back."""

    def __init__(self, regions: Sequence[str], config: TapeSACConfig) -> None:
        self.regions = list(regions)
        self.config = config
        self._secondary_max: dict[str, int] = {}

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

    def edges(self, key: Bucket) -> dict[str, int]:
        """Per region, the upper token edge of bucket ``key``: the counts its plan is solved for."""
        return {r: upper_edge(q, self._factor(r)) for r, q in zip(self.regions, key)}

    def _secondary(self, region: str) -> bool:
        return region in self.config.secondary_regions

    def _factor(self, region: str) -> float:
        if self._secondary(region):
            return self.config.secondary_bucket_factor
        return self.config.primary_bucket_factor
