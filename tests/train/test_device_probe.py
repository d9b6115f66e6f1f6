"""The device probe: its matchings, its transfers, and training after it bit-identical to training without it."""

import itertools

import jax
import numpy as np
import pytest

from jaxdist.controller.health import name_probe
from jaxdist.train.device_probe import DeviceProbe, ProbeOnRequest, pair_rounds
from jaxdist.train.trainer import Trainer
from tests.train.test_callbacks import _config


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_pair_rounds_time_every_pair_once_in_disjoint_rounds(n):
    rounds = pair_rounds(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    flat = [p for r in rounds for p in r]
    assert sorted(flat) == list(itertools.combinations(range(n), 2))
    for r in rounds:
        ends = [i for p in r for i in p]
        assert len(ends) == len(set(ends))


def _groups():
    devs = jax.devices()[:8]
    return [devs[i : i + 2] for i in range(0, 8, 2)], ["n0", "n1", "n2", "n3"]


def test_the_probe_swaps_the_buffers_of_a_pair_device_by_device():
    groups, names = _groups()
    probe = DeviceProbe(groups, names, nbytes=16, reps=1)
    x = jax.device_put(np.arange(8 * 4, dtype=np.float32), jax.sharding.NamedSharding(probe.mesh, jax.P("probe")))
    y = np.asarray(probe._permute("t", probe.pair_perm([(0, 2)]))(x)).reshape(8, 4)
    # Devices 0,1 (node 0) and 4,5 (node 2) swap; the others receive nothing (zeros).
    want = np.zeros((8, 4), np.float32)
    src = np.arange(32, dtype=np.float32).reshape(8, 4)
    want[[0, 1, 4, 5]] = src[[4, 5, 0, 1]]
    np.testing.assert_array_equal(y, want)
    ring = np.asarray(probe._permute("r", probe.ring_perm())(x)).reshape(8, 4)
    np.testing.assert_array_equal(ring, src[[6, 7, 0, 1, 2, 3, 4, 5]])


def test_training_after_a_probe_is_bit_identical_and_the_probe_names_an_injected_slow_link(tmp_path):
    def train(run, probe):
        with Trainer(_config(tmp_path / run, 2, steps=4)) as t:
            reports = []
            if probe:
                # The controller's request (id 1) seen from step 2 on: the probe runs once, between steps 2 and 3.
                delay = lambda what, node: 0.05 if what == "pair:n1:n3" else 0.0  # noqa: E731
                t.add_callback(
                    ProbeOnRequest(
                        2,
                        lambda: DeviceProbe(*_groups(), nbytes=4096, reps=5, delay=delay),
                        lambda: 1,
                        lambda i, rec: reports.append((i, rec)),
                    )
                )
            t.fit()
            return jax.device_get(t.state["params"]), reports

    plain, _ = train("plain", False)
    probed, reports = train("probed", True)
    assert jax.tree.all(jax.tree.map(np.array_equal, plain, probed))
    assert [(i, r["step"]) for i, r in reports] == [(1, 2)]
    rec = reports[0][1]
    assert sorted((a, b) for a, b, *_ in rec["pairs"]) == list(itertools.combinations(["n0", "n1", "n2", "n3"], 2))
    slow = {(a, b): s for a, b, s, _ in rec["pairs"]}
    assert slow[("n1", "n3")] >= 0.05 and all(s < 0.05 for k, s in slow.items() if k != ("n1", "n3"))
    assert all(s > 0 for s in rec["compute_s"].values()) and rec["ring_s"] > 0 and rec["allreduce_s"] > 0
    verdict = name_probe(rec)
    assert (verdict["kind"], verdict["link"], verdict["node"]) == ("link", ["n1", "n3"], None), rec
