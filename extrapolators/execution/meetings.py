"""Collectives' meetings in the runtime: every member of a collective's group posts it (the
same key); the last to arrive starts it through the communication model, with, in a
symmetric run, the same collective of every copy of the representatives (its images).

`Meetings(runtime)` is an object the runtime holds. What it gives: `arrive(gpu, task)`, a
call (not a generator) that returns the meeting, a dict whose "done" event fires when the
collective has ended and whose "begin" is then the instant it started; errors for a GPU
outside the group, a second post, or posts that differ in group or operation; `open` (key
-> the meeting in progress: the runtime's deadlock report reads who is missing); and the
runtime's `collective_bytes` kept up to date ({op: bytes}, every copy counted).
What it needs of the runtime: `env`, `comm` (a CommModel; `start_many` is used where it
has one), `symmetry` (None, or an extrapolators.execution.symmetry.Symmetry whose `plan`,
`image` and `image_copies` it calls), `collective_bytes`, and `open_images` (image
operations started and not ended, which the Twins it makes count down).
"""

from __future__ import annotations

from extrapolators.execution.symmetry import Twins
from extrapolators.execution.tasks import Collective
from networks.groups import fire_at
from triosim.common.errors import SimulationError


class Meetings:
    """The collectives' meetings of a runtime (module docstring: what it gives, needs)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.env, self.comm = runtime.env, runtime.comm
        self.symmetry = runtime.symmetry
        self.collective_bytes = runtime.collective_bytes  # the runtime's dict, updated here
        self.open: dict[str, dict] = {}  # key -> the meeting in progress
        # (id(group), root) -> (group, images, the groups and roots of its calls)
        self._calls: dict = {}
        self._means: dict = {}  # id(sizes) -> (sizes, mean bytes per GPU, GPUs): `_count`

    def arrive(self, gpu, task: Collective) -> dict:
        """Meet the other members; the last to arrive runs the algorithm. Returns the
        meeting: wait for its "done" event, then "begin" is the collective's start."""
        meet = self.open.get(task.key)
        if meet is None:
            if gpu not in task.group:
                raise SimulationError(
                    f"GPU {gpu} posted collective {task.key!r} of group {task.group} it is not in"
                )
            if self.symmetry is None:
                left, images = set(task.group), None
            else:  # the representatives in the group meet; images run with them
                left, images = self.symmetry.plan(task.group)
            meet = self.open[task.key] = {
                "left": left,
                "done": self.env.event(),
                "begin": None,
                "task": task,
                "images": images,
            }
        elif (meet["task"].group is not task.group and meet["task"].group != task.group) or (
            meet["task"].op != task.op
        ):  # identity first: comparing an N-GPU group per arrival is O(N^2) per collective
            raise SimulationError(f"collective {task.key!r} posted with different groups or ops")
        elif meet["task"].sizes is not task.sizes and meet["task"].sizes != task.sizes:
            raise SimulationError(f"all-to-all {task.key!r} posted with different sizes")
        if gpu not in meet["left"]:
            raise SimulationError(f"GPU {gpu} posted collective {task.key!r} twice")
        meet["left"].discard(gpu)
        if not meet["left"]:
            meet["begin"] = self.env.now
            if meet["images"] and hasattr(self.comm, "start_many"):  # no process: callbacks
                self._start_with_images(task, meet["done"], meet["images"])
            else:
                self.env.process(self._run_collective(task, meet["done"], meet["images"]))
        return meet

    def _run_collective(self, task: Collective, done, images=None):
        twins = None
        if images:  # the same collective in every copy, started at the same instant
            twins = self._start_images(task, images)
        yield from self._run_on(task, task.group, task.root)
        if twins is not None:
            twins.rep_done(self.env.now)
        del self.open[task.key]
        done.succeed()

    def _start_images(self, task: Collective, images) -> Twins:
        """A process per image of `task` (each copy's group), their ends checked by the
        Twins returned against the representatives'."""
        twins = Twins(self.runtime, f"collective {task.key!r}")
        for k, group in zip(self.symmetry.image_copies(task.group), images, strict=True):
            self.runtime.open_images += 1
            self.env.process(self._image_collective(task, group, k, twins))
        return twins

    def _start_with_images(self, task: Collective, done, images) -> None:
        """The representatives' collective and its images through `comm.start_many`: one
        transfer group for all copies; when the last transfer lands, each image's end
        checked against the representatives' (as `_image_collective` would, without a
        process per copy), its bytes counted, the meeting closed, and `done` fired at the
        collective's end, with no process and no event between (so `done` comes before
        other events of that instant that were set after the landing)."""
        groups, roots = self._many_call(task, images)

        def then(ends, end):
            self._count(task, copies=len(images) + 1)
            if ends.count(ends[0]) != len(ends):  # (all at one instant: nothing to check)
                Twins(self.runtime, f"collective {task.key!r}").check_all(ends[0], ends[1:])
            del self.open[task.key]
            fire_at(self.env, done, end)

        self.comm.start_many(
            task.op, groups, task.nbytes, then, task.key, roots, task.algorithm, task.sizes
        )

    def _many_call(self, task: Collective, images) -> tuple:
        """(the groups, their roots) of `comm.start_many` for `task` and its images; the
        same list objects for the same group, images and root (a call's plans are kept
        for them: networks' and the NCCL model's caches check them by identity)."""
        key = (id(task.group), task.root)
        hit = self._calls.get(key)
        if hit is not None and hit[0] is task.group and hit[1] is images:
            return hit[2], hit[3]
        roots = [task.root] + [
            None if task.root is None else self.symmetry.image(task.root, k)
            for k in self.symmetry.image_copies(task.group)
        ]
        groups = [task.group, *images]
        self._calls[key] = (task.group, images, groups, roots)
        return groups, roots

    def prepare(self, tasks) -> None:
        """Prepare, before the run, what the communication model will be asked for each of
        the collectives `tasks` (the representatives', one of each call): `start_many` of
        those with images, `run` of those over whole classes (a network moving flows by orbits
        checks each collective's transfers there: `QuotientBroken` before the run, not in
        it)."""
        for t in tasks:
            images = self.symmetry.plan(t.group)[1]
            if images:
                groups, roots = self._many_call(t, images)
                self.comm.prepare_many(t.op, groups, t.nbytes, roots, t.algorithm, t.sizes)
            else:  # over whole classes: run once, over the whole group
                self.comm.prepare_one(t.op, t.group, t.nbytes, t.root, t.algorithm, t.sizes)

    def _count(self, task: Collective, copies: int = 1) -> None:
        """`copies` runs of `task` in `collective_bytes`, one after another: its bytes, or
        for an all-to-all of uneven sizes its mean per-GPU buffer (summed once)."""
        sizes = task.sizes
        if sizes is None:
            nbytes = task.nbytes
        else:  # (kept by the table's object: a mode passes the same one at every call)
            n = len(task.group)
            hit = self._means.get(id(sizes))
            if hit is None or hit[0] is not sizes or hit[2] != n:
                if len(self._means) >= 1024:  # (a replay may build a table per call)
                    self._means.clear()
                hit = self._means[id(sizes)] = (sizes, sum(map(sum, sizes)) / n, n)
            nbytes = hit[1]
        total = self.collective_bytes.get(task.op, 0.0)
        for _ in range(copies):  # (added one at a time: the same float sum as copy by copy)
            total += nbytes
        self.collective_bytes[task.op] = total

    def _image_collective(self, task: Collective, group, k: int, twins):
        """Copy k's image of a representatives' collective (its tag: the same key)."""
        root = None if task.root is None else self.symmetry.image(task.root, k)
        yield from self._run_on(task, group, root)
        twins.image_done(self.env.now)

    def _run_on(self, task: Collective, group, root):
        """`task` run by the communication model over `group` (a representatives' or an
        image's: uneven sizes are per position in the group, the same for every copy),
        then counted."""
        yield from self.comm.run(
            task.op,
            group,
            task.nbytes,
            tag=task.key,
            root=root,
            algorithm=task.algorithm,
            sizes=task.sizes,
        )
        self._count(task)
