"""The few collectives a distributed save needs, over a torch.distributed process group.

Only metadata travels through the object collectives (pickled between the job's own
ranks, never read from storage); tensor bytes move point-to-point, only boundary pieces,
as flat ``uint8`` tensors whose sizes every rank agreed on first.

Every fallible step of a save ends in an *agreement* (:meth:`Comm.agree`): each rank
contributes its error (or None) with its payload, and if any rank failed, every rank
raises the same error naming the failing ranks, at once, instead of leaving the others
blocked in the next collective until the process group times out.

Planning gathers every rank's payload on one coordinator in two levels
(:meth:`Comm.coordinate`): ranks send theirs to a group leader (:func:`leader_groups`: about
the square root of the world, consecutive ranks), which merges equal objects of its group
into one message to rank 0; the answer comes back the same way, each leader cutting its
group's answer into its ranks' parts. Every message travels point to point at its exact
size (``gather_object``/``scatter_object_list`` pad every rank's message to the largest).
"""

from __future__ import annotations

import contextlib
import gc
import math
import pickle
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..errors import OptionError, agreed_error


def describe(error: BaseException | None) -> tuple[str, str] | None:
    """An error as the (class name, message) sent to the other ranks."""
    return None if error is None else (type(error).__name__, str(error))


OPERATIONS = ("save", "async_save", "load")
"""The collective operations :meth:`Comm.start` tells apart (a save, an asynchronous save
and a sharded load each run their own sequence of collectives)."""

FLAT_MAX_WORLD = 64
"""Up to this many ranks, one group: every rank sends its payload to rank 0 directly."""


def leader_groups(world: int) -> list[range]:
    """The groups of a two-level gather: ``ceil(sqrt(world))`` groups of consecutive ranks
    (sizes differing by at most one), each led by its first rank; one group up to
    :data:`FLAT_MAX_WORLD` ranks."""
    if world <= FLAT_MAX_WORLD:
        return [range(world)]
    n = math.isqrt(world - 1) + 1
    return [range(world * i // n, world * (i + 1) // n) for i in range(n)]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a leader or the coordinator builds large
    graphs of objects (unpickled lists, the plan, its parts): each full collection scans every
    live object, which made planning 16,384 ranks about 30% slower. It runs again after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Comm:
    """A process group, or a single process when ``group`` is None and torch.distributed
    is not initialised, or when ``local`` (this process alone, as a converter writes)."""

    def __init__(self, group: Any = None, *, local: bool = False) -> None:
        self.group = group
        self.active = not local and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.active else 0
        self.world = dist.get_world_size(group) if self.active else 1

    @property
    def device(self) -> torch.device:
        """Where tensors must be for this group's backend (CUDA for NCCL)."""
        if self.active and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if not self.active:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._global(0), group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def coordinate(
        self,
        error: BaseException | None,
        what: str,
        payload: Any,
        plan: Callable[[list[Any], list[range]], list[Any]],
        split: Callable[[Any, range, list[Any]], list[Any]],
        compact: Callable[[list[Any]], list[Any]] | None = None,
        on_failure: Callable[[], None] | None = None,
    ) -> Any:
        """Gather ``(error, payload)`` on rank 0 through the group leaders of
        :func:`leader_groups`; when no rank failed, rank 0 runs ``plan(payloads, groups)``
        (one answer per group), each leader ``split(answer, group, its ranks' payloads)``
        (one part per rank of its group), and each rank gets its part. ``compact`` (on each
        leader, over its group's payloads) may replace equal objects by one, so that they
        travel and are unpickled once. Any failure (``plan``'s too) is raised on every rank,
        as :meth:`agree` does, once rank 0 ran ``on_failure`` (giving back what it holds for
        them all, so that no rank sees the failure before that is done); ``split`` (it only
        cuts up the answer) and ``on_failure`` must not fail."""
        groups = leader_groups(self.world)
        mine = next(g for g in groups if self.rank in g)
        leader = mine[0]
        # 1. ranks -> their leader; each leader -> rank 0: (failures, payloads) of its group
        if self.rank != leader:
            self._send_recv({leader: _dumps((describe(error), payload))}, ())
            failures, part = _loads(self._send_recv({}, (leader,))[leader])
            raise_failures(self, failures or {}, error, what)
            return part
        with gc_paused():  # (a leader builds large graphs of objects: the lists, the plan, the parts)
            return self._lead(error, what, payload, (plan, split, compact, on_failure), groups, mine)

    def _lead(
        self, error: BaseException | None, what: str, payload: Any, steps: tuple, groups: list[range], mine: range
    ) -> Any:
        """:meth:`coordinate` on a group leader (rank 0 leads the first group)."""
        plan, split, compact, on_failure = steps
        leader = mine[0]
        got = self._send_recv({}, [r for r in mine if r != leader])
        entries = [(describe(error), payload) if r == leader else _loads(got[r]) for r in mine]
        failed = {r: e for r, (e, _) in zip(mine, entries) if e is not None}
        payloads = [p for _, p in entries]
        if compact is not None and not failed:
            payloads = compact(payloads)
        if self.rank != 0:
            self._send_recv({0: _dumps((failed, payloads))}, ())
            failures, answer = _loads(self._send_recv({}, (0,))[0])
        else:
            got = self._send_recv({}, [g[0] for g in groups[1:]])
            received = [(failed, payloads), *(_loads(got[g[0]]) for g in groups[1:])]
            failures = {r: e for f, _ in received for r, e in f.items()}
            answers: list[Any] = [None] * len(groups)
            if not failures:
                try:
                    answers = plan([p for _, ps in received for p in ps], groups)
                except BaseException as e:
                    error, failures = e, {0: describe(e)}  # type: ignore[dict-item]
            if failures and on_failure is not None:
                on_failure()
            self._send_recv({g[0]: _dumps((failures, a)) for g, a in zip(groups[1:], answers[1:])}, ())
            answer = answers[0]
        # 2. each leader -> its ranks: their parts
        parts = [None] * len(mine) if failures else split(answer, mine, payloads)
        self._send_recv({r: _dumps((failures, p)) for r, p in zip(mine, parts) if r != leader}, ())
        raise_failures(self, failures or {}, error, what)
        return parts[0]

    def _send_recv(self, sends: dict[int, bytes], sources: Sequence[int]) -> dict[int, bytes]:
        """Send each ``sends[dst]`` to rank ``dst`` and receive one message from each of
        ``sources``, each at its exact size (the sizes go first)."""
        if not self.active:
            return {}
        sizes = self.exchange(
            {d: torch.tensor([len(b)], dtype=torch.int64).view(torch.uint8) for d, b in sends.items()},
            {s: 8 for s in sources},
        )
        got = self.exchange(
            {d: torch.frombuffer(bytearray(b), dtype=torch.uint8) for d, b in sends.items()},
            {s: int(t.view(torch.int64)[0]) for s, t in sizes.items()},
        )
        return {s: t.numpy().tobytes() for s, t in got.items()}

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def exchange(self, sends: dict[int, torch.Tensor], recv_sizes: dict[int, int]) -> dict[int, torch.Tensor]:
        """Send ``sends[dst]`` (flat uint8) to each ``dst``; receive ``recv_sizes[src]`` bytes from each ``src``."""
        recvs = {src: torch.empty(n, dtype=torch.uint8, device=self.device) for src, n in recv_sizes.items()}
        if not sends and not recvs:
            return recvs
        ops = [dist.P2POp(dist.isend, t.to(self.device), self._global(dst), self.group) for dst, t in sorted(sends.items())]
        ops += [dist.P2POp(dist.irecv, t, self._global(src), self.group) for src, t in sorted(recvs.items())]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return {src: t.cpu() for src, t in recvs.items()}

    def start(self, operation: str, what: str, error: BaseException | None = None) -> None:
        """The first collective of every collective operation (:data:`OPERATIONS`): one
        all-reduce of three integers, the same whatever the operation, so that ranks calling
        different ones (one saving while another loads) are told apart and refused on every
        rank at once, where each would otherwise wait in its own next collective until the
        group times out. ``error`` (this rank's failure before it, such as opening its store)
        is raised here, and the others raise one naming the highest failing rank."""
        if not self.active:
            if error is not None:
                raise error
            return
        code = OPERATIONS.index(operation) + 1
        votes = torch.tensor([code, -code, 0 if error is None else self.rank + 1], dtype=torch.int64, device=self.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group)
        high, low, failed = int(votes[0]), -int(votes[1]), int(votes[2])
        if error is not None:
            raise error
        if high != low:
            raise OptionError(
                f"{what}: the ranks of the process group called different operations at once ({OPERATIONS[low - 1]} "
                f"and {OPERATIONS[high - 1]}; this rank {operation}): each is a collective, every rank must call the same"
            )
        if failed:
            raise agreed_error(f"{what} failed on rank {failed - 1} (and maybe others) before it began: see that rank's error",
                               {failed - 1: ("Exception", "failed before the collective began")})

    def agree(self, error: BaseException | None, what: str, payload: Any = None, *, own: bool = False) -> list[Any]:
        """All-gather ``(error, payload)``; return every rank's payload, or raise on every
        rank if any rank failed ``what`` (a single process re-raises its own error). With
        ``own``, a failing rank raises its own error, as one process would, and only the
        others the agreed one naming the failing ranks (loads: the failing rank's error is
        the one its caller can act on)."""
        gathered = self.all_gather((describe(error), payload))
        if own and error is not None:
            raise error
        raise_failures(self, {r: e for r, (e, _) in enumerate(gathered) if e is not None}, error, what)
        return [p for _, p in gathered]


def raise_failures(
    comm: Comm, failures: dict[int, tuple[str, str]], error: BaseException | None, what: str
) -> None:
    """Raise one error naming every failing rank of ``what`` (see :func:`describe`); a
    single process raises its own error unchanged."""
    if not failures:
        return
    if not comm.active and error is not None:
        raise error
    detail = "; ".join(f"rank {r}: {name}: {msg}" for r, (name, msg) in sorted(failures.items()))
    raise agreed_error(f"{what} failed on {len(failures)} of {comm.world} ranks: {detail}", failures) from error


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _loads(raw: bytes) -> Any:
    return pickle.loads(raw)  # (from a rank of this job, as torch's object collectives do)
