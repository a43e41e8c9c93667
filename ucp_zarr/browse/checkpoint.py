"""The face a user holds: :func:`open` and :class:`Checkpoint`, a
:class:`~ucp_zarr.protocol.reader.CheckpointReader` with what browsing adds (the rules it
was placed by, summaries, statistics and the Jupyter display).

Reading lives in the protocol; this face depends on it, on the statistics and on the HTML,
and only the browsing faces above it (runs, the CLI) import it: the HTML renderers are handed
a checkpoint, they never import this module."""

from __future__ import annotations

import os
from typing import Any

from .inspect import CheckpointSummary, TensorStats, checkpoint_summary, tensor_stats
from .notebook import CheckpointTree, checkpoint_html, stats_html, summary_html, tensor_html
from ..io.factory import open_store
from ..io.store import Store
from ..protocol.reader import CheckpointReader, TensorReader, commit_meta
from ..rules.language import Rules


class Checkpoint(CheckpointReader):
    """A read-only view of a committed checkpoint. Tensors are read lazily, by slice.

    Every read is checked: the array documents against the digests in the commit record,
    each shard's trailer against the checkpoint's save id and the shard's key, each chunk
    against its crc32c and the one its shard recorded. With ``hmac_key`` the commit record's
    signature, the shards' seals and every chunk's SHA-256 are verified too."""

    def __getitem__(self, key: str) -> "TensorView":
        self._entry(key)
        return TensorView(self, key)

    @property
    def rules(self) -> Rules | None:
        """The rules the saving job placed its state dict by (:func:`ucp_zarr.place`), if any."""
        rules = self.meta.layout.get("rules")
        return None if rules is None else Rules.from_dict(rules)

    def _repr_html_(self) -> str:
        return checkpoint_html(self)

    def summary(self, depth: int = 2) -> CheckpointSummary:
        """Elements (model, optimizer state, other) and bytes by module (parameter FQNs cut to
        ``depth`` names) and by dtype, from the commit record (see
        :func:`ucp_zarr.browse.inspect.checkpoint_summary`)."""
        return checkpoint_summary(self, depth, html=summary_html)

    def tree(self, filter: str | None = None) -> CheckpointTree:
        """The tree of groups (as the checkpoint displays it) of the tensors whose key or
        parameter name holds ``filter`` (case-insensitive), for Jupyter."""
        return CheckpointTree(self, filter)


class TensorView(TensorReader):
    """A lazy tensor of a checkpoint: ``view[0:128, :]`` reads only the overlapping chunks."""

    def stats(self, *, max_bytes: int = 64 << 20) -> TensorStats:
        """min, max, mean, std, L2 norm, NaN/Inf counts, computed chunk by chunk with bounded
        memory (see :func:`ucp_zarr.browse.inspect.tensor_stats`)."""
        return tensor_stats(self.checkpoint, self.key, max_bytes=max_bytes, html=stats_html)

    def _repr_html_(self) -> str:
        return tensor_html(self)


def open(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None, hmac_key: bytes | None = None
) -> Checkpoint:
    """Open the committed checkpoint at ``path`` (a local path or fsspec URL), read-only.

    With ``hmac_key``, refuse a checkpoint that is unsigned or whose signature does not
    verify, and check every shard's seal and every chunk's SHA-256 as it is read."""
    return open_store_checkpoint(open_store(path, storage_options), hmac_key)


def open_store_checkpoint(store: Store, hmac_key: bytes | None = None) -> Checkpoint:
    """:func:`open` for a store already made."""
    return Checkpoint(*commit_meta(store, hmac_key), hmac_key)
