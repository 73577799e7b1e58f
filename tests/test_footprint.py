"""A batch's footprint (networks.packet.footprint): each link's bytes added at once where
that is exact gives the floats of one add per flow and link in flow order (np.add.at),
and the batch's total those of one add per flow (seq_sum); where it would not be exact
it adds nothing and says so. Then a network that starts one batch many times counts
what one that starts its transfers anew each time counts, float for float."""

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from networks import PacketSwitchNetwork
from networks import topology as topo
from networks.groups import seq_sum
from networks.packet.footprint import EXACT, Footprint


def _flows(rng, n_links, n_flows, whole):
    nh = rng.integers(1, 5, n_flows)
    flat = np.concatenate([rng.choice(n_links, h, replace=False) for h in nh])
    nb = rng.integers(1, 10**7, n_flows).astype(float)
    if not whole:
        nb[rng.integers(n_flows)] += 0.3
    return flat, nh, nb


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n_links=st.integers(4, 40),
    n_flows=st.integers(1, 60),
    whole=st.booleans(),
    start=st.sampled_from(["zero", "whole", "fraction", "huge"]),
)
def test_the_footprints_adds_are_the_adds_one_by_one_or_none(seed, n_links, n_flows, whole, start):
    rng = np.random.default_rng(seed)
    flat, nh, nb = _flows(rng, n_links, n_flows, whole)
    base = {
        "zero": np.zeros(n_links),
        "whole": rng.integers(0, 10**9, n_links).astype(float),
        "fraction": rng.random(n_links) * 1e9,
        "huge": np.full(n_links, EXACT - 2.0),
    }[start]
    want = base.copy()
    np.add.at(want, flat, np.repeat(nb, nh))
    got = base.copy()
    fp = Footprint(flat, nh, nb)
    assert fp.links.tolist() == sorted(set(flat.tolist()))
    exact = whole and start in ("zero", "whole")
    assert fp.add_link_bytes(got) is exact
    assert got.tobytes() == (want if exact else base).tobytes()  # (nothing added: None)
    acc = float(base[0])
    total = fp.add_to(acc)
    assert total == seq_sum(acc, nb) if exact else total is None


def test_no_footprint_sums_where_they_could_be_inexact_or_overflow():
    flat, nh = np.array([0, 1, 1, 2]), np.array([2, 2])
    huge = Footprint(flat, nh, np.array([1e308, 1e308]))  # (a sum would overflow)
    assert huge.sums is None and huge.total is None and huge.links.tolist() == [0, 1, 2]
    fp = Footprint(flat, nh, np.array([3.0, 5.0]))
    assert fp.sums.tolist() == [3.0, 8.0, 5.0] and fp.total == 8.0
    below = np.array([-(2.0**60), 0.0, 0.0])  # (a negative count: no bound from above)
    assert not fp.add_link_bytes(below) and below[0] == -(2.0**60)
    assert fp.add_to(-(2.0**60)) is None and fp.add_to(2.0) == 10.0


def test_a_batch_started_again_counts_as_the_same_transfers_started_anew():
    # 8 GPUs on a switch, an all-to-all of whole byte counts started three times (its
    # footprint from the second start on: checked to run), then a round with a fraction
    # of a byte (started once: the adds one by one)
    pairs = [(a, b) for a in range(8) for b in range(8) if a != b]
    rounds = [[(a, b, float(1000 * (a + 1) + b)) for a, b in pairs]] * 3
    rounds.append([(a, b, 1000.5 + a) for a, b in pairs])

    used = []
    real = Footprint.add_link_bytes

    def counted(self, link_bytes):
        used.append(real(self, link_bytes))
        return used[-1]

    def run(reuse: bool):
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, topo.switch_star(8, 50e9, 1e-6))
        batches = [net.batch(r) for r in rounds] if reuse else None

        def proc():
            for i, r in enumerate(rounds):
                b = batches[0 if i < 3 else 3] if reuse else r
                yield net.transfer_all(b)

        env.process(proc())
        env.run()
        return net

    once = run(False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Footprint, "add_link_bytes", counted)
        again = run(True)
    assert used == [True, True]  # (the second and third starts)
    assert again.link_bytes.tobytes() == once.link_bytes.tobytes()
    assert again.bytes_sent == once.bytes_sent == sum(x for r in rounds for *_, x in r)
    assert again.bytes_delivered == once.bytes_delivered
