"""The planner: frontiers of save sets per region type, a knapsack across them, token buckets.

Python (numpy for the peak model's DP); no torch. Graphs in, frontiers and plans out.
"""

from .buckets import PRIMARY_FACTOR, SECONDARY_FACTOR, bucket, upper_edge
from .exact import exact_frontier
from .frontier import FrontierResult, frontier, solve_frontier
from .knapsack import KnapsackResult, RegionFrontier, solve_knapsack
from .model import (
    Graph,
    PlanGraph,
    block_nodes,
    block_time,
    candidates,
    replay_nodes,
    replay_time,
    saved_bytes,
)
from .points import Point, gap, pareto

__all__ = [
    "PRIMARY_FACTOR",
    "SECONDARY_FACTOR",
    "FrontierResult",
    "Graph",
    "KnapsackResult",
    "PlanGraph",
    "Point",
    "RegionFrontier",
    "block_nodes",
    "block_time",
    "bucket",
    "candidates",
    "exact_frontier",
    "frontier",
    "gap",
    "pareto",
    "replay_nodes",
    "replay_time",
    "saved_bytes",
    "solve_frontier",
    "solve_knapsack",
    "upper_edge",
]
