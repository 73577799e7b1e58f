"""A symmetric run that falls back builds a second network and communication model; they
take the first attempt's routes and NCCL analysis (pure functions of the graph and the
model's options) instead of working them out again, and the run is the same."""

from __future__ import annotations

import dataclasses

import pytest
import simpy

import triosim.simulation.wiring as wiring
from extrapolators.communication.nccl.model import Nccl
from networks import PacketSwitchNetwork
from networks import topology as topo
from tests.test_symmetry import GPT2, threed
from triosim.simulation.wiring import Simulation, load_any_trace


@pytest.fixture(scope="module")
def gpt2():
    return load_any_trace(GPT2)


def _net(graph, **options):
    return PacketSwitchNetwork(simpy.Environment(), graph, **options)


def test_routes_are_taken_only_for_the_same_graph_and_routing_before_anything_is_routed():
    g = topo.ring(4, 1e9, 1e-6)
    first = _net(g)
    first.path_links(0, 2)
    assert _net(g).reuse_routes(first.routes)
    assert not _net(topo.ring(4, 1e9, 1e-6)).reuse_routes(first.routes)  # another graph
    assert not _net(g, routing="hops").reuse_routes(first.routes)
    late = _net(g)
    late.transfer(0, 1, 1e3)  # a transfer routed already: its own routes are in use
    assert not late.reuse_routes(first.routes)
    taken = _net(g)
    taken.reuse_routes(first.routes)
    assert taken.routes is first.routes and taken.path_links(0, 2) is not None


def test_an_analysis_is_taken_only_with_the_same_options_network_and_nothing_planned():
    g = topo.multi_node(2, 4, 300e9, 50e9, 1e-6, 2e-6)
    net = _net(g)
    first = Nccl(net.env, net, gpu="H100-SXM")
    first.plan("allreduce", (0, 1, 2, 3), 1e6)

    def model(options=None, gpu="H100-SXM", routes=first.routes):
        n = _net(g)
        n.reuse_routes(routes)
        return Nccl(n.env, n, options, gpu=gpu)

    ok = model()
    assert ok.reuse_analysis(first.analysis) and ok.analysis is first.analysis
    assert ok.plan("allreduce", (0, 1, 2, 3), 1e6) == first.plan("allreduce", (0, 1, 2, 3), 1e6)
    other = dataclasses.replace(first.options, nvls=not first.options.nvls)
    assert not model(other).reuse_analysis(first.analysis)
    assert not model(gpu="A100-80GB").reuse_analysis(first.analysis)  # another architecture
    assert not model(routes=Nccl(net.env, _net(g)).routes).reuse_analysis(first.analysis)
    planned = model()
    planned.plan("allreduce", (4, 5), 1e6)
    assert not planned.reuse_analysis(first.analysis)


def test_a_run_that_falls_back_reuses_the_first_attempts_analysis_and_is_the_same(
    gpt2, monkeypatch
):
    # every TP rank 1 at a quarter of the bandwidth: the finest declaration breaks in the
    # run, the next one holds (tests/test_symmetry.py)
    cfg = threed("auto", heterogeneity={"bandwidth": {g: 4.0 for g in range(1, 16, 2)}})
    made, init = [], Nccl.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(Nccl, "__init__", record)
    r = Simulation(cfg, trace=gpt2).run()
    assert "fell back from" in r.symmetry and len(made) == 2
    assert made[1].analysis is made[0].analysis and made[1].net.routes is made[0].net.routes
    assert sim_kept_after(cfg, gpt2) == {}  # not held once the run is over
    monkeypatch.setattr(wiring, "_reuse_routes", lambda *a, **k: None)
    monkeypatch.setattr(wiring, "_reuse_analysis", lambda *a, **k: None)
    made.clear()
    fresh = Simulation(cfg, trace=gpt2).run()
    assert made[1].analysis is not made[0].analysis
    assert fresh.symmetry == r.symmetry
    assert fresh.iteration_times == r.iteration_times
    assert fresh.timeline.equals(r.timeline)


def sim_kept_after(cfg, trace) -> dict:
    sim = Simulation(cfg, trace=trace)
    sim.run()
    return sim._kept
