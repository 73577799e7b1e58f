"""Landing: how the packet network's fast engine hands transfers over on arrival (`Landing`).

Transfers are kept per group (networks.groups.Group); a flow in the table (its `gid`,
`idx` columns) and a ring job name a transfer by (group id, index).
"""

from __future__ import annotations

import numpy as np

from networks.base import Network
from networks.groups import Group, Records, at, seq_sum


class Landing:
    """The transfer groups in flight, and their landing on arrival.

    Gives:
    * `register(g)` gives a group an id, under which it stays in `groups` until its last
      transfer lands.
    * `deliver(rows)` lands the table's flows `rows` one path latency from now;
      `land_later(arrival, delay, gids, idxs)` lands transfers at given times. Either way
      with one timer per distinct arrival time, the transfers within one landing in the
      order given (so records and events come in the order the reference engine gives).
    * `land(gids, idxs)` lands transfers now (`land_one(gid, idxs)`: of one group): sets their arrival times, counts the bytes
      delivered and the transfers in flight, fires each transfer's event (transfer_group)
      and, when a group's last transfer lands, its `done` event with its Records
      (transfer_all), and forgets the group.
    * `per_record`: the network is of a subclass that overrides `Network._deliver` (to
      count deliveries itself); it then gets one `_deliver` call per transfer, with its
      record, instead.

    Needs: the network (`env`, its counters `bytes_delivered` and `in_flight`, its
    `_deliver`) and its flow table (networks.packet.table: `lat`, `gid`, `idx`).
    """

    def __init__(self, net: Network, table) -> None:
        self.net, self.env, self.table = net, net.env, table
        self.groups: dict[int, Group] = {}  # groups with transfers not yet landed
        self.solving = False  # the engine is in a solve (FastEngine.finish)
        self.next_gid = 0
        # a subclass that counts deliveries itself gets one _deliver call per transfer
        self.per_record = type(net)._deliver is not Network._deliver

    def register(self, g: Group) -> int:
        gid = self.next_gid
        self.next_gid += 1
        self.groups[gid] = g
        return gid

    def deliver(self, done: np.ndarray) -> None:
        """Deliver the flows at indices `done`: at once without latency, else one timer per
        distinct arrival time (the order of delivery within it kept)."""
        t = self.table
        lat, gid, idx = t.lat[done], t.gid[done], t.idx[done]
        self.land_later(self.env.now + lat, lat, gid, idx)

    def land_later(self, arrival, delay, gid, idx):
        """Land transfers (gid, idx) at `arrival` (delay: arrival - now as a timeout sees
        it; None: schedule at the absolute time)."""
        now = self.env.now
        for ks in arrival_runs(arrival):
            t = float(arrival[ks[0]])
            g, i = gid[ks], idx[ks]
            if t <= now:
                self.land(g, i)
            elif delay is not None:
                self.env.timeout(float(delay[ks[0]])).callbacks.append(
                    lambda _e, g=g, i=i: self.land(g, i)
                )
            else:
                at(self.env, t, lambda _e, g=g, i=i: self.land(g, i))

    def land(self, gids, idxs) -> None:
        """Transfers (group id, index) arrive now."""
        net, groups = self.net, self.groups
        if self.per_record:  # a subclass delivers record by record
            for g, i in zip(gids.tolist(), idxs.tolist(), strict=True):
                grp = groups[g]
                rec = grp.record(i)
                net._deliver(rec, grp if grp.events is None else grp.events[i])
                grp.ends[i] = rec.end
            return
        for g in dict.fromkeys(gids.tolist()):
            self.land_one(g, idxs if gids[0] == gids[-1] == g else idxs[gids == g])

    def land_one(self, g: int, sel) -> None:
        """Transfers `sel` (indices) of group `g` arrive now (a subclass that delivers
        record by record: through `land`)."""
        if self.per_record:
            self.land(np.full(len(sel), g), sel)
            return
        net, grp = self.net, self.groups[g]
        grp.ends[sel] = self.env.now
        net.bytes_delivered = seq_sum(net.bytes_delivered, grp.nb[sel])
        net.in_flight -= len(sel)
        grp.pending -= len(sel)
        if grp.events is not None:
            for i in sel.tolist():
                grp.events[i].succeed(grp.record(i))
        if grp.pending == 0:
            del self.groups[g]
            # the log keeps the group's transfers, not what waited on them (its event and
            # the callbacks' closures: kept to the end of the run, a 1,024-GPU run's
            # collectives left a million objects for each garbage collection to walk)
            done, grp.done, grp.events = grp.done, None, None
            if done is None:
                return
            if self.solving and getattr(done, "calls_back", False):
                # a callback (networks.groups.Then) may start transfers: not in the middle
                # of a solve; at this instant, after it, as an event's callbacks would run
                at(self.env, self.env.now, lambda _e: done.succeed(Records(grp)))
            else:
                done.succeed(Records(grp))


def arrival_runs(arrival: np.ndarray) -> list:
    """The positions of each distinct arrival time, one array per time in order of first
    appearance, the order kept within each."""
    if len(arrival) == 1 or (arrival == arrival[0]).all():
        return [np.arange(len(arrival))]
    _, first, inv = np.unique(arrival, return_index=True, return_inverse=True)
    perm = np.argsort(inv, kind="stable")
    runs = np.split(perm, np.cumsum(np.bincount(inv))[:-1])
    return [runs[j] for j in np.argsort(first)]
