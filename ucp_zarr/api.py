"""The Python face: :func:`save`, :func:`async_save` and :func:`load` (the calls live in
:mod:`.protocol.saving` and :mod:`.protocol.loader`, ``open`` in :mod:`.browse.checkpoint`)."""

from .protocol.loader import load
from .protocol.saving import BACKGROUND_NICE, DEFAULT_WORKERS, MAX_NICE, async_save, save, wait_for_pending_save

__all__ = ["BACKGROUND_NICE", "DEFAULT_WORKERS", "MAX_NICE", "async_save", "load", "save", "wait_for_pending_save"]
