"""The request shape: every (nodes, GPUs per node, which nodes) against brute force over node sets."""

from __future__ import annotations

import itertools
import random

import pytest

from jaxdist.config import ConfigError
from jaxdist.slurm.shape import choose_shape, largest_block, leftover, place


def brute_largest_block(free):
    """The most GPUs of equal count per node over every set of nodes: max over sets S of |S| x min free in S."""
    names = list(free)
    return max(
        (len(s) * min(free[n] for n in s) for r in range(1, len(names) + 1) for s in itertools.combinations(names, r)),
        default=0,
    )


def test_largest_block_is_the_best_equal_block():
    rng = random.Random(0)
    for _ in range(200):
        free = {f"n{i}": rng.randint(0, 8) for i in range(rng.randint(1, 6))}
        assert largest_block(free) == brute_largest_block(free), free
    assert largest_block({"a": 4, "b": 8, "c": 0, "d": 8}) == 16 and largest_block({}) == 0


def test_leftover_counts_whole_nodes():
    totals = {"a": 8, "b": 8, "c": 8}
    assert leftover({"a": 8, "b": 3, "c": 0}, totals) == (8, 1, 11)


def test_placement_leaves_the_largest_block():
    # 4 GPUs on one node: the partly used node, not a whole one
    free, totals = {"n1": 4, "n2": 8, "n3": 0, "n4": 8}, {f"n{i}": 8 for i in range(1, 5)}
    assert place(free, totals, 1, 4) == ("n1",)
    assert place(free, totals, 1, 8) == ("n2",)  # equal: Slurm's node order
    # 2 x 4: on n1+n2 or n1+n4 the next job can get 8 GPUs (one node); on n2+n4, 12 (3 nodes x 4)
    assert place(free, totals, 2, 4) == ("n2", "n4")
    assert place(free, totals, 3, 8) is None


@pytest.mark.parametrize("seed", range(6))
def test_choice_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(1, rng.randint(2, 6))]
    totals = {n: 8 for n in nodes}
    free = {n: rng.choice([0, 2, 4, 5, 8, 8]) for n in nodes}
    if not any(free.values()):
        free[nodes[0]] = 8
    standbys, max_nodes, min_nodes = rng.randint(0, 1), rng.choice([0, 2]), rng.choice([1, 1, 2])
    table = {(n, k): rng.choice([None, rng.uniform(1, 2), 1.0]) for n in range(1, 7) for k in range(1, 9)}

    def cost(n, k):
        return table[(n, k)]

    want = []
    for k in range(1, 9):
        fit = [n for n in nodes if free[n] >= k]
        for n in range(1, len(fit) + 1):
            count = n + min(standbys, len(fit) - n)  # the standbys that are left
            if (max_nodes and n > max_nodes) or n < min_nodes or cost(n, k) is None:
                continue
            for chosen in itertools.combinations(fit, count):
                after = {x: free[x] - (k if x in chosen else 0) for x in nodes}
                want.append((cost(n, k), tuple(-x for x in leftover(after, totals)), n * k))
    if not want:
        with pytest.raises(ConfigError, match="no free GPUs fit the job"):
            choose_shape(free, totals, cost, standbys, max_nodes, min_nodes)
        return
    got = choose_shape(free, totals, cost, standbys, max_nodes, min_nodes)
    best = got.best
    assert best.key() == min(want)
    fit = sum(1 for n in nodes if free[n] >= best.gpus_per_node)
    assert len(best.nodes) == best.training + min(standbys, fit - best.training) and all(
        free[n] >= best.gpus_per_node for n in best.nodes
    )
    assert [s.key() for s in got.tried] == sorted(s.key() for s in got.tried)


def test_standbys_never_keep_a_shape_from_running():
    """Issue 35 item 7: 4 free nodes, min_nodes=4 and a standby asked for: 4 nodes train, no standby."""
    free = totals = {f"n{i}": 8 for i in range(1, 5)}
    best = choose_shape(free, totals, lambda n, k: 1.0 / (n * k), standbys=1, min_nodes=4).best
    assert (best.training, best.gpus_per_node, len(best.nodes)) == (4, 8, 4)
    best = choose_shape(free, totals, lambda n, k: 1.0 / (n * k), standbys=1, max_nodes=3).best
    assert (best.training, len(best.nodes)) == (3, 4)  # a node is left: it is the standby
