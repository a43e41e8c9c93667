"""The few collectives a distributed save needs, over a torch.distributed process group.

Only metadata travels through ``all_gather_object`` (pickled
between the job's own ranks, never read from storage); tensor bytes move point-to-point,
only boundary pieces, as flat ``uint8`` tensors.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


class Comm:
    """A process group, or a single process when ``group`` is None and torch.distributed
    is not initialised."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
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

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise the same error on every rank if any rank failed ``what`` (a single process
        raises its own error unchanged)."""
        self.raise_failures(self.all_gather(describe(error)) if self.active else [None], error, what)

    def raise_failures(self, described: Sequence[str | None], error: BaseException | None, what: str) -> None:
        """Raise one error naming every rank whose entry of ``described`` (see
        :func:`describe`, gathered from all ranks) reports a failure of ``what``."""
        if not self.active:
            if error is not None:
                raise error
            return
        failed = [(r, e) for r, e in enumerate(described) if e is not None]
        if failed:
            from .errors import CheckpointError

            detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise CheckpointError(f"{what} failed on {len(failed)} of {self.world} ranks: {detail}") from error


def describe(error: BaseException | None) -> str | None:
    """An error as the short text sent to the other ranks."""
    return None if error is None else f"{type(error).__name__}: {error}"
