"""Geometric token buckets: exact bucket ids and upper edges, and input checks."""

from __future__ import annotations

import pytest

from tapesac_core.plan import PRIMARY_FACTOR, SECONDARY_FACTOR, bucket, upper_edge


@pytest.mark.parametrize(
    ("tokens", "factor", "q", "edge"),
    [
        (1, PRIMARY_FACTOR, 0, 1),
        (2, PRIMARY_FACTOR, 7, 2),
        (1000, PRIMARY_FACTOR, 72, 1051),
        (4096, PRIMARY_FACTOR, 87, 4390),
        (100_000, PRIMARY_FACTOR, 120, 101_979),
        (1, SECONDARY_FACTOR, 0, 1),
        (1000, SECONDARY_FACTOR, 30, 1009),
        (4096, SECONDARY_FACTOR, 37, 4814),
        (8, 2.0, 3, 15),  # an exact power starts its bucket
        (7, 2.0, 2, 7),
    ],
)
def test_bucket_and_upper_edge(tokens, factor, q, edge):
    assert bucket(tokens, factor) == q
    assert upper_edge(q, factor) == edge


@pytest.mark.parametrize("factor", [PRIMARY_FACTOR, SECONDARY_FACTOR, 2.0])
def test_every_count_lies_between_the_edges_of_its_bucket(factor):
    for tokens in [*range(1, 3000), 65_535, 65_536, 10**9]:
        q = bucket(tokens, factor)
        assert tokens <= upper_edge(q, factor)
        assert q == 0 or upper_edge(q - 1, factor) < tokens
        assert bucket(upper_edge(q, factor), factor) == q


@pytest.mark.parametrize(
    ("tokens", "factor", "message"),
    [
        (0, 1.1, "tokens must be an int >= 1"),
        (2.5, 1.1, "tokens must be an int >= 1"),
        (True, 1.1, "tokens must be an int >= 1"),
        (10, 1.0, "factor must be a finite number > 1"),
        (10, float("inf"), "factor must be a finite number > 1"),
    ],
)
def test_bucket_rejects_bad_input(tokens, factor, message):
    with pytest.raises(ValueError, match=message):
        bucket(tokens, factor)


def test_upper_edge_rejects_bad_input():
    with pytest.raises(ValueError, match="bucket must be an int >= 0"):
        upper_edge(-1, 1.1)
    with pytest.raises(ValueError, match="factor must be"):
        upper_edge(3, 0.5)
