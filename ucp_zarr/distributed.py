"""The few collectives a distributed save needs, over a torch.distributed process group.

Only metadata travels through the object collectives (pickled between the job's own
ranks, never read from storage); tensor bytes move point-to-point, only boundary pieces,
as flat ``uint8`` tensors whose sizes every rank agreed on first.

Every fallible step of a save ends in an *agreement* (:meth:`Comm.agree`): each rank
contributes its error (or None) with its payload, and if any rank failed, every rank
raises the same error naming the failing ranks, at once, instead of leaving the others
blocked in the next collective until the process group times out.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import agreed_error


def describe(error: BaseException | None) -> tuple[str, str] | None:
    """An error as the (class name, message) sent to the other ranks."""
    return None if error is None else (type(error).__name__, str(error))


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

    def scatter(self, parts: list[Any] | None) -> Any:
        """Rank 0's ``parts[r]`` on each rank ``r`` (``parts`` is only read on rank 0)."""
        if not self.active:
            assert parts is not None
            return parts[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, parts if self.rank == 0 else None, src=self._global(0), group=self.group)
        return out[0]

    def coordinate(self, error: BaseException | None, what: str, payload: Any, plan: Callable[[list[Any]], list[Any]]) -> Any:
        """Gather ``(error, payload)`` on rank 0, which (when no rank failed) runs ``plan``
        on every rank's payload and sends each rank ``r`` its part ``plan(...)[r]``. Only
        rank 0 receives every payload; any failure (``plan``'s too) is raised on every rank,
        as :meth:`agree` does."""
        gathered = self.gather((describe(error), payload))
        parts: list[Any] | None = None
        if gathered is not None:
            failures = {r: e for r, (e, _) in enumerate(gathered) if e is not None}
            if not failures:
                try:
                    parts = [(None, p) for p in plan([p for _, p in gathered])]
                except BaseException as e:
                    error, failures = e, {0: describe(e)}  # type: ignore[dict-item]
            if failures:
                parts = [(failures, None)] * self.world
        failures, part = self.scatter(parts)
        raise_failures(self, failures or {}, error, what)
        return part

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

    def agree(self, error: BaseException | None, what: str, payload: Any = None) -> list[Any]:
        """All-gather ``(error, payload)``; return every rank's payload, or raise on every
        rank if any rank failed ``what`` (a single process re-raises its own error)."""
        gathered = self.all_gather((describe(error), payload))
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
