"""Which committed steps a retention policy deletes (pure: no storage)."""

from __future__ import annotations

from typing import Collection, Iterable


def check_policy(keep_last: int | None, keep_every: int | None) -> None:
    """Raise ValueError for a policy that is not ``None`` or a positive integer."""
    for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or a positive integer, got {value!r}")


def steps_to_delete(
    committed: Iterable[int],
    *,
    keep_last: int | None,
    keep_every: int | None = None,
    protected: Collection[int] = (),
    within_limit: Collection[int] = (),
) -> list[int]:
    """The committed steps to delete, ascending.

    Kept: the ``keep_last`` newest committed steps (all of them when ``keep_last`` is None,
    so that ``keep_every`` alone deletes nothing), every step that is a multiple of
    ``keep_every``, every ``protected`` step (being read or written), and always the newest
    committed step. The steps of ``within_limit`` are kept too, counted among the
    ``keep_last`` (as the Hugging Face Trainer's ``save_total_limit`` counts its best
    checkpoint): fewer of the other newest steps are kept, the newest always.
    """
    check_policy(keep_last, keep_every)
    steps = sorted(set(committed))
    if keep_last is None or not steps:
        return []
    counted = (set(within_limit) & set(steps)) | {steps[-1]}
    others = [s for s in steps if s not in counted]
    keep = counted | set(others[max(0, len(others) - max(0, keep_last - len(counted))):]) | set(protected)
    if keep_every is not None:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]
