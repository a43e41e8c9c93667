"""Reading a committed checkpoint: :class:`CheckpointReader` and its lazy :class:`TensorReader`.

The protocol's reading half: every read checked, nothing displayed. The face users hold,
:class:`ucp_zarr.Checkpoint` (``ucp_zarr.open``), adds what browsing needs (rules, summaries,
HTML) on top of it, so that reading never imports the browsing layer.

Torch-free until a torch tensor is asked for (:meth:`CheckpointReader.read`, :class:`TensorReader`
indexing): :meth:`CheckpointReader.read_numpy` and :meth:`CheckpointReader.select_numpy` give the
stored values as numpy arrays, which is what the read-only CLI and :mod:`ucp_zarr.browse.inspect` use."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from ..io.arrayio import (
    Seal,
    ShardHead,
    as_storage,
    decode_shard_head,
    read_box,
    read_shard_head,
    read_small_shard,
    read_whole_shard,
    verify_shard,
    writable_view,
)
from ..format.dtypes import is_lossless_cast, stored_dtype_by_name
from ..errors import (
    CheckpointError,
    CheckpointReplacedError,
    CorruptChunkError,
    DtypeMismatchError,
    FormatError,
    LayoutError,
    NotACheckpointError,
    ShapeMismatchError,
    UnknownKeyError,
    did_you_mean,
)
from ..format.documents import ATTRIBUTE, METADATA_FILE, ArrayMeta, dump_document, parse_document
from ..format.commit_record import CheckpointMeta, TensorEntry
from ..format.integrity import array_digest, check_signature, document_digest
from ..layout import Box
from ..format.statedict import from_json
from ..io.factory import open_store
from ..io.store import Store, at_once, in_order
from .transaction import committed_store

if TYPE_CHECKING:
    import torch


class CheckpointReader:
    """A read-only view of a committed checkpoint. Tensors are read lazily, by slice.

    Every read is checked: the array documents against the digests in the commit record,
    each shard's trailer against the checkpoint's save id and the shard's key, each chunk
    against its crc32c and the one its shard recorded. With ``hmac_key`` the commit record's
    signature, the shards' seals and every chunk's SHA-256 are verified too."""

    def __init__(self, store: Store, meta: CheckpointMeta, hmac_key: bytes | None = None, *,
                 origin: Store | None = None) -> None:
        self.store = store
        self.meta = meta
        self.origin = origin or store
        """The path opened (``store`` is where its committed checkpoint was found then)."""
        self.seal = Seal(meta.save_id, meta.authenticated, hmac_key)
        self._arrays: dict[str, ArrayMeta] = {}
        self._heads: dict[tuple[str, tuple[int, ...]], ShardHead] = {}
        self._lock = threading.Lock()

    # --- mapping face --------------------------------------------------------------------

    def keys(self) -> list[str]:
        """The flattened tensor keys, spelled as DCP flattens them (each stored tensor once:
        the aliases of tied tensors are in :attr:`ties`)."""
        return list(self.meta.tensors)

    @property
    def ties(self) -> dict[str, str]:
        """Tied tensors: alias key -> the canonical key whose array holds its values. Every
        read of an alias (``ck["model.lm_head.weight"]``, :meth:`read`) reads that array."""
        return dict(self.meta.ties)

    def __iter__(self) -> Iterator[str]:
        return iter(self.meta.tensors)

    def __len__(self) -> int:
        return len(self.meta.tensors)

    def __contains__(self, key: object) -> bool:
        return key in self.meta.tensors or key in self.meta.ties

    def __getitem__(self, key: str) -> "TensorReader":
        self._entry(key)
        return TensorReader(self, key)

    def array_path(self, key: str) -> str:
        """Where the tensor's Zarr array lives, relative to the checkpoint root."""
        return self._entry(key).path

    @property
    def metadata(self) -> dict[str, Any]:
        """Non-tensor state (by flattened key) and checkpoint facts, as plain data.

        ``rank_values`` holds the values that differed between the saving ranks, by rank."""
        values = {k: from_json(v, k) for k, v in self.meta.values.items()}
        return {
            "step": values.get("step", values.get("deepspeed.global_steps")),  # (a DeepSpeed checkpoint's)
            "created": self.meta.created,
            "library": self.meta.library,
            "world_size": self.meta.world_size,
            "layout": self.meta.layout,
            "values": values,
            "rank_values": {k: {r: from_json(v, k) for r, v in per.items()} for k, per in self.meta.rank_values.items()},
            "per_rank_tensors": sorted(k for k, e in self.meta.tensors.items() if e.ranks is not None),
        }


    # --- reading -------------------------------------------------------------------------

    def _entry(self, key: str) -> TensorEntry:
        try:
            return self.meta.tensors[self.meta.canonical(key)]
        except KeyError:
            raise UnknownKeyError(f"no tensor {key!r} in checkpoint {self.store.url}" + self._near(key)) from None

    def _near(self, key: str) -> str:
        """What ``key`` may have meant: a value of that name, or close tensor keys."""
        if key in self.meta.values or key in self.meta.rank_values:
            return f" ({key!r} is one of its values, not a tensor)"
        return did_you_mean(key, [*self.meta.tensors, *self.meta.ties])

    def _path(self, key: str, rank: int | None) -> str:
        entry = self._entry(key)
        try:
            return entry.array(rank).path
        except KeyError:
            raise KeyError(
                f"tensor {key!r} has no copy of rank {rank}; saved ranks: {sorted(entry.ranks or ())}"
            ) from None

    def document_json(self, path: str) -> Any:
        """A metadata document as parsed JSON (not to be changed), checked as :meth:`document`
        checks it: the consolidated copy, already parsed with the commit record, when its
        bytes match the digest, else the stored object."""
        node = self.meta.consolidated_node(path)
        if node is not None and document_digest(dump_document(node)) == self.meta.documents.get(path):
            return node
        return parse_document(self.document(path, stored=True), f"{self.store.url}/{path}")

    def document(self, path: str, *, stored: bool = False) -> bytes:
        """A metadata document (``<path>``), checked against its digest in the commit record:
        the root's consolidated copy when it matches, else (or with ``stored``) the object."""
        where = f"{self.store.url}/{path}"
        want = self.meta.documents.get(path)
        if want is None:
            raise FormatError(f"{where} is not a document of this checkpoint (no digest in its commit record)")
        raw = None if stored else self.meta.consolidated_document(path)
        if raw is not None and document_digest(raw) == want:
            return raw
        try:
            raw = self.store.read(path)
        except FileNotFoundError:
            raise CorruptChunkError(f"{where} is missing") from None
        if document_digest(raw) != want:
            raise CorruptChunkError(f"{where} was changed or replaced after the checkpoint was committed")
        return raw

    def array_meta(self, key: str, rank: int | None = None) -> ArrayMeta:
        """The array metadata of ``key`` (its zarr.json, read once, checked against the
        index entry of ``key`` on every call); ``rank`` picks the copy of per-rank state."""
        path = self._path(key, rank)
        where = f"{self.store.url}/{path}/{METADATA_FILE}"
        with self._lock:
            meta = self._arrays.get(path)
        if meta is None:
            with self._unless_replaced():
                meta = self._parse_array_meta(f"{path}/{METADATA_FILE}", where)
            with self._lock:
                self._arrays[path] = meta
        entry = self._entry(key)
        if meta.key != self.meta.canonical(key):
            raise FormatError(f"{where} holds tensor {meta.key!r}, the index says {self.meta.canonical(key)!r}")
        if meta.shape != entry.shape or meta.dtype.name != entry.dtype:
            raise FormatError(
                f"{where}: shape {list(meta.shape)} {meta.dtype.name}, but the index says "
                f"{list(entry.shape)} {entry.dtype}"
            )
        if (entry.ranks is not None) != (meta.rank is not None) or (rank is not None and meta.rank not in (None, rank)):
            raise FormatError(f"{where}: per-rank copy of rank {meta.rank}, the index says {rank}")
        return meta

    def _parse_array_meta(self, doc_path: str, where: str) -> ArrayMeta:
        """An array document, checked as :meth:`document_json` checks it and parsed as
        :meth:`ArrayMeta.from_zarr_json` parses it: from the consolidated copy in one
        serialisation when the document it describes has the committed digest
        (:meth:`ArrayMeta.from_committed`), else from the checked document."""
        node, want = self.meta.consolidated_node(doc_path), self.meta.documents.get(doc_path)
        if node is not None and want is not None:
            meta = ArrayMeta.from_committed(node, where, want)
            if meta is not None:
                return meta
        return ArrayMeta.from_zarr_json(self.document_json(doc_path), where)

    def _head(self, path: str, meta: ArrayMeta, shard: tuple[int, ...], whole: memoryview | None = None) -> ShardHead:
        """The shard's checked index and trailer, read once (from ``whole``, the shard's object,
        when given)."""
        with self._lock:
            head = self._heads.get((path, shard))
        if head is None:
            with self._unless_replaced():
                if whole is not None:
                    head = decode_shard_head(self.store, path, meta, shard, self.seal, whole)
                else:
                    head = read_shard_head(self.store, path, meta, shard, self.seal)
            with self._lock:
                self._heads[(path, shard)] = head
        return head

    @contextlib.contextmanager
    def _unless_replaced(self) -> Iterator[None]:
        """Raise a :class:`CorruptChunkError` of what is read inside as
        :class:`CheckpointReplacedError` when the checkpoint at :attr:`origin` is no longer
        the one being read (an overwrite committed, or a delete, while it was read)."""
        try:
            yield
        except CorruptChunkError as e:
            try:
                now = commit_meta(self.origin)[1].save_id
            except (NotACheckpointError, FileNotFoundError):
                now = None
            except (CheckpointError, OSError):  # (a record there that cannot be read: the corruption stands)
                raise e from None
            if now == self.meta.save_id:
                raise
            raise CheckpointReplacedError(
                f"the checkpoint at {self.origin.url} was {'replaced' if now else 'deleted'} while it was being read "
                f"({e}): nothing is corrupt; read it again") from e

    def _read_into(self, key: str, box: Box, raw: np.ndarray, rank: int | None) -> None:
        """Fill ``raw`` (storage dtype, shape of ``box``, any strides) with ``box`` of ``key``.
        A shard that ``box`` covers whole, whose index is not known yet, is read in one
        request: its chunks straight into ``raw`` and its index from its end where the store
        can (:func:`read_whole_shard`), else, when small, the whole object."""
        with self._unless_replaced():
            self._read_shards(key, box, raw, rank)

    def _read_shards(self, key: str, box: Box, raw: np.ndarray, rank: int | None) -> None:
        meta = self.array_meta(key, rank)
        path = self._path(key, rank)
        for shard in meta.grid.shards_overlapping(box):
            with self._lock:
                known = (path, shard) in self._heads
            whole = None
            if not known and box.contains(meta.grid.shard_box(shard)):
                head = read_whole_shard(self.store, path, meta, box, raw, shard, self.seal)
                if head is not None:
                    with self._lock:
                        self._heads[(path, shard)] = head
                    continue
                whole = read_small_shard(self.store, path, meta, shard, self.seal, WHOLE_SHARD_BYTES)
            read_box(self.store, path, meta, box, raw, shard, self._head(path, meta, shard, whole), whole)

    def _check_box(
        self, key: str, box: Box | None, rank: int | None, corners: bool = True
    ) -> tuple[ArrayMeta, Box]:
        meta = self.array_meta(key, rank)
        box = box or Box.whole(meta.shape)
        if box.ndim != len(meta.shape) or any(s > n for s, n in zip(box.stop, meta.shape)):
            raise IndexError(f"tensor {key!r}: box {box} is outside its shape {list(meta.shape)}")
        if corners and not box.is_empty():  # the first and last shards exist before memory is committed
            path = self._path(key, rank)
            for corner in (box.offset, tuple(o + n - 1 for o, n in zip(box.offset, box.shape))):
                self._head(path, meta, tuple(i // s for i, s in zip(corner, meta.grid.shard_shape)))
        return meta, box

    def read_numpy(self, key: str, box: Box | None = None, rank: int | None = None) -> np.ndarray:
        """Read ``box`` (default: all) of tensor ``key`` as a numpy array of the stored values,
        without torch: bf16 and float8 tensors come back as their raw bits (``uint16`` /
        ``uint8``; :func:`ucp_zarr.browse.values.widen` turns them into float32)."""
        meta, box = self._check_box(key, box, rank)
        with allocating(key, box.shape, meta.dtype.itemsize):
            out = np.empty(box.shape, dtype=meta.dtype.numpy_dtype)
        self._read_into(key, box, out, rank)
        return out

    def select_numpy(self, key: str, index: Any, rank: int | None = None) -> np.ndarray:
        """``tensor[index]`` as a numpy array of the stored values (see :meth:`read_numpy`),
        reading only the chunks the selection touches. ``index``: ints, slices (any step,
        negative too) and ``...``, as in numpy."""
        shape = self._entry(key).shape
        box, post = index_to_box(index, tuple(shape))
        steps = [abs(p.step) if isinstance(p, slice) else 1 for p in post]
        flips = tuple(slice(None, None, -1) if isinstance(p, slice) and p.step < 0 else slice(None) for p in post)
        picks = tuple(0 if isinstance(p, int) else slice(None) for p in post) + (...,)  # (0-d: an array)
        if all(s == 1 for s in steps):
            return self.read_numpy(key, box, rank)[flips][picks]
        # a stepped selection: read, per chunk row/column, only the span of selected indices
        meta, box = self._check_box(key, box, rank)
        chunk = meta.grid.chunk_shape
        spans = [_spans(o, n, st, c) for o, n, st, c in zip(box.offset, box.shape, steps, chunk)]
        shape = tuple(sum(k for *_, k in sp) for sp in spans)
        with allocating(key, shape, meta.dtype.itemsize):
            out = np.empty(shape, dtype=meta.dtype.numpy_dtype)
        for combo in itertools.product(*spans):
            part = Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo))
            data = self.read_numpy(key, part, rank)[tuple(slice(None, None, st) for st in steps)]
            out[tuple(slice(c[2], c[2] + c[3]) for c in combo)] = data
        return out[flips][picks]

    def read(
        self,
        key: str,
        box: Box | None = None,
        out: "torch.Tensor | None" = None,
        rank: int | None = None,
        *,
        allow_lossy_cast: bool = False,
    ) -> "torch.Tensor":
        """Read ``box`` (default: all) of tensor ``key`` into ``out`` (allocated if None).

        ``out`` may have any device and strides, and another dtype when every saved value
        converts to it exactly (``float16`` into ``float32``, say); a lossy conversion
        (``float32`` into ``bfloat16``, floats into integers) needs ``allow_lossy_cast``.
        It is filled directly when numpy can write its memory as the saved dtype (a CPU
        tensor of that dtype, any strides), else through a temporary and ``copy_`` (another
        device or dtype, a conjugate or negative view, an inference tensor), so that
        ``out`` shows exactly the saved values; one that no read can fill exactly (see
        :func:`check_destination`) is refused. ``rank`` picks the copy of per-rank state
        (default: the lowest saved rank's).
        """
        out, fill = self.prepare_read(key, box, out, rank, allow_lossy_cast=allow_lossy_cast)
        fill()
        return out

    def prepare_read(
        self,
        key: str,
        box: Box | None = None,
        out: "torch.Tensor | None" = None,
        rank: int | None = None,
        *,
        allow_lossy_cast: bool = False,
    ) -> "tuple[torch.Tensor, Callable[[], None]]":
        """:meth:`read` in two steps: everything but the reading, here (the checks, ``out``
        allocated or viewed as numpy, its autograd version bumped), and a function that
        reads into it. Where ``out`` is filled directly, that function calls no torch, so
        that a pool of threads running many (a load) does not trade the GIL at every torch
        call (each releases it): a 16 MiB load of 96 tensors on 2 cores, 4 threads, took
        64 ms (warm) and 65 ms (cold) with the whole of ``read`` in the threads, 43 and 49
        ms with this."""
        import torch
        from torch.autograd.graph import increment_version

        meta = self.array_meta(key, rank)
        box = box or Box.whole(meta.shape)
        if out is not None:
            check_destination(key, out)
            if tuple(out.shape) != box.shape:
                raise ShapeMismatchError(f"tensor {key!r}: destination shape {list(out.shape)} != {list(box.shape)}")
            src = meta.dtype.torch_dtype
            if not allow_lossy_cast and not is_lossless_cast(src, out.dtype):
                raise DtypeMismatchError(
                    f"tensor {key!r}: the checkpoint holds {src}, the destination is {out.dtype}; converting "
                    "loses information (pass allow_lossy_cast=True to convert anyway)"
                )
        meta, box = self._check_box(key, box, rank, corners=out is None)
        if out is None:
            with allocating(key, box.shape, meta.dtype.itemsize):
                out = torch.empty(box.shape, dtype=meta.dtype.torch_dtype)
            raw = as_storage(out, meta).numpy()
            return out, lambda: self._read_into(key, box, raw, rank)
        raw = writable_view(out, meta)
        if raw is not None:
            if not out.is_inference():
                increment_version(out)  # (as copy_ does: autograd sees the change)
            return out, lambda: self._read_into(key, box, raw, rank)
        dest = out

        def staged() -> None:
            # through a bounded host buffer, block by block (an inference tensor is written in
            # inference mode, the only place it may be)
            with torch.no_grad(), torch.inference_mode() if dest.is_inference() else contextlib.nullcontext():
                for block in row_blocks(box, meta.dtype.itemsize, STAGE_BYTES):
                    tmp = torch.empty(block.shape, dtype=meta.dtype.torch_dtype)
                    self._read_into(key, block, as_storage(tmp, meta).numpy(), rank)
                    dest[block.relative_to(box).slices()].copy_(tmp)

        return out, staged

    def verify(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Check everything: every document against its digest, every chunk of every array
        (every per-rank copy too) against its crc32c and its shard's trailer, every array
        against its digest, streaming one bounded buffer at a time per shard being checked
        (as many shards at once as the store keeps requests in flight: one on disks).
        Returns the bytes of tensor data checked; ``progress(done, total)`` is called after
        each shard (where shards are checked at once, from the checking threads, one call at
        a time).

        Raises :class:`~ucp_zarr.CorruptChunkError` naming the first bad object (in the order
        of the record's tensors, their copies and their shards, whichever was checked first),
        :class:`~ucp_zarr.CheckpointReplacedError` when the checkpoint was replaced meanwhile."""
        with self._unless_replaced():
            return self._verify(progress)

    def _verify(self, progress: Callable[[int, int], None] | None) -> int:
        at_once(self.store, lambda path: self.document(path, stored=True), self.meta.documents)
        everything = sum(e.nbytes * len(e.ranks or (None,)) for e in self.meta.tensors.values())
        lock, done = threading.Lock(), [0]

        def steps() -> Iterator[tuple[Any, ...]]:
            """Each shard to check, then its array's end; an array whose document does not
            parse ends the walk where it comes."""
            for key, entry in self.meta.tensors.items():
                for rank in sorted(entry.ranks) if entry.ranks is not None else [None]:
                    try:
                        meta = self.array_meta(key, rank)
                    except Exception as e:
                        yield ("error", e)
                        return
                    count = math.prod(meta.grid.shard_counts)
                    for n, shard in enumerate(meta.grid.all_shards(), 1):
                        yield ("shard", entry, rank, meta, shard, entry.nbytes * n // count - entry.nbytes * (n - 1) // count)
                    yield ("array", key, entry, rank)

        def check(step: tuple[Any, ...]) -> Any:
            if step[0] != "shard":
                return step[1] if step[0] == "error" else step
            _, entry, rank, meta, shard, share = step
            try:
                seal = verify_shard(self.store, entry.array(rank).path, meta, shard, self.seal)
            except Exception as e:
                return e
            if progress is not None:
                with lock:
                    done[0] += share
                    progress(done[0], everything)
            return seal

        total, seals = 0, []
        with contextlib.closing(in_order(self.store, check, steps())) as outcomes:  # (stops the pool on a raise)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
                if isinstance(outcome, bytes):
                    seals.append(outcome)
                    continue
                _, key, entry, rank = outcome
                ref = entry.array(rank)
                if array_digest(seals) != ref.digest:
                    raise CorruptChunkError(
                        f"{self.store.url}/{ref.path} (tensor {key!r}): its shards do not match the array digest "
                        "in the commit record (a shard was replaced)"
                    )
                total, seals = total + entry.nbytes, []
        self._check_consolidated()  # (last: a document that does not parse is named first)
        return total

    def _check_consolidated(self) -> None:
        """The root's consolidated copy of every document (what zarr-python's ``open_group``
        and xarray read instead of the documents) must be that document, byte for byte (its
        digest in the commit record), and name no other node. :class:`CorruptChunkError`
        naming the first that is not (this library reads the document itself then, but
        other readers would read another array)."""
        where = f"{self.store.url}/{METADATA_FILE}"
        for path, want in self.meta.documents.items():
            raw = self.meta.consolidated_document(path)
            if raw is not None and document_digest(raw) != want:
                raise CorruptChunkError(
                    f"{where}: its consolidated metadata of {path} differs from that document (the digest in the "
                    "commit record): Zarr readers that read consolidated metadata (zarr.open_group, xarray) would "
                    "read another array"
                )
        known = {path.removesuffix("/" + METADATA_FILE) for path in self.meta.documents}
        extra = sorted(set(self.meta.consolidated) - known)
        if extra:
            raise CorruptChunkError(
                f"{where}: its consolidated metadata names {extra[0]!r}, which is no document of the commit record"
            )

    # --- reprs ---------------------------------------------------------------------------

    def _groups(self) -> dict[str, list[tuple[str, str, Any]]]:
        groups: dict[str, list[tuple[str, str, Any]]] = {}
        for key, e in self.meta.tensors.items():
            group, _, name = e.path.partition("/")
            groups.setdefault(group, []).append((name, key, e))
        return groups

    def nbytes(self) -> int:
        """The bytes of every tensor's data, each saving rank's copy of per-rank state counted
        (:meth:`CheckpointMeta.nbytes`: what is stored, as ``list_steps`` counts it)."""
        return self.meta.nbytes()

    def __repr__(self) -> str:
        lines = [
            f"<ucp_zarr.Checkpoint {self.store.url}: {len(self)} tensors, {human_bytes(self.nbytes())}, "
            f"step={self.metadata['step']!r}, world_size={self.meta.world_size}>"
        ]
        rules = self.meta.layout.get("rules")
        if rules is not None:
            lines.append(f"  placed by rules: {len(rules.get('params', []))} parameter rule(s) (see .rules)")
        if self.meta.ties:
            lines.append(f"  tied: {len(self.meta.ties)} alias(es) stored once (see .ties)")
        for group, items in self._groups().items():
            lines.append(f"  {group}/")
            for name, _, e in items:
                rule = "" if e.rule is None else "  " + json.dumps(e.rule, separators=(",", ":"))
                lines.append(f"    {name:<16} {str(list(e.shape)):<16} {e.dtype}{rule}")
        return "\n".join(lines)


WHOLE_SHARD_BYTES = 4 << 20
"""A shard object up to this size that a read covers whole is fetched in one request."""
STAGE_BYTES = 64 << 20
"""The most host memory a read into a device tensor (or another dtype) stages at a time."""


@contextlib.contextmanager
def allocating(key: str, shape: tuple[int, ...], itemsize: int) -> Iterator[None]:
    """Name tensor ``key`` in the error of an allocation of ``shape`` that memory cannot hold
    (numpy's ``MemoryError``, torch's allocator ``RuntimeError``): a :class:`MemoryError`."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and ("alloc" not in str(e) or type(e).__name__ == "OutOfMemoryError"):
            raise  # (not the host allocator's: a CUDA out-of-memory error keeps its type)
        raise MemoryError(
            f"tensor {key!r}: {math.prod(shape) * itemsize:,} bytes (shape {list(shape)}) do not fit in memory; read "
            "a part of it (ck[key][0:1024, :]), or check the checkpoint (ucp-zarr verify): its record may be damaged"
        ) from e


def check_destination(key: str, out: "torch.Tensor") -> None:
    """Refuse (:class:`~ucp_zarr.LayoutError` naming ``key``) a tensor that no read can fill
    exactly: one on the meta device (it has no memory), a DTensor (its shape is global, its
    memory local: read into ``to_local()``, or load it with :func:`ucp_zarr.load`), or one
    whose elements may share memory (an ``expand``-ed view, overlapping strides), where
    one element's value would overwrite another's."""
    from .fragments import is_dtensor

    if out.device.type == "meta":
        raise LayoutError(
            f"tensor {key!r}: the destination is on the meta device and has no memory to fill; materialise it "
            "first (module.to_empty(device=...), or torch.empty_like(t, device=...))"
        )
    if is_dtensor(out):
        raise LayoutError(f"tensor {key!r}: the destination is a DTensor; read into its to_local(), or use ucp_zarr.load")
    if may_overlap(tuple(out.shape), tuple(out.stride())):
        raise LayoutError(
            f"tensor {key!r}: elements of the destination share memory (shape {list(out.shape)}, strides "
            f"{list(out.stride())}: an expanded or overlapping view), so it cannot hold the saved values; "
            "pass a tensor with memory of its own (.clone() or .contiguous())"
        )


def may_overlap(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether two elements of a strided view may share memory: unless, taking the dims of
    extent > 1 by increasing stride, each stride exceeds the span of the dims before it."""
    span = 0
    for stride, n in sorted((abs(st), n) for st, n in zip(strides, shape) if n > 1):
        if stride <= span:
            return True
        span += stride * (n - 1)
    return False


def row_blocks(box: Box, itemsize: int, limit: int) -> list[Box]:
    """``box`` cut along its leading dims into blocks of at most ``limit`` bytes (a block is
    at least one element of the last dim's extent)."""
    if box.ndim == 0 or box.numel * itemsize <= limit:
        return [box]
    inner = math.prod(box.shape[1:]) * itemsize
    if inner > limit and box.ndim > 1:
        return [
            Box((box.offset[0] + i, *b.offset), (1, *b.shape))
            for i in range(box.shape[0])
            for b in row_blocks(Box(box.offset[1:], box.shape[1:]), itemsize, limit)
        ]
    rows = max(1, limit // inner)
    return [
        Box((box.offset[0] + i, *box.offset[1:]), (min(rows, box.shape[0] - i), *box.shape[1:]))
        for i in range(0, box.shape[0], rows)
    ]


class TensorReader:
    """A lazy tensor of a checkpoint: ``view[0:128, :]`` reads only the overlapping chunks."""

    def __init__(self, checkpoint: CheckpointReader, key: str) -> None:
        self.checkpoint = checkpoint
        self.key = key
        entry = checkpoint._entry(key)
        self.path = entry.path
        self.dtype_name = entry.dtype
        """The torch dtype's name (``"bfloat16"``); :attr:`dtype` is the torch dtype."""
        self._shape = entry.shape

    @property
    def shape(self) -> "torch.Size":
        import torch

        return torch.Size(self._shape)

    @property
    def dtype(self) -> "torch.dtype":
        return stored_dtype_by_name(self.dtype_name).torch_dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        return math.prod(self._shape)

    def read(self) -> "torch.Tensor":
        return self.checkpoint.read(self.key)

    def numpy(self, index: Any = ...) -> np.ndarray:
        """``self[index]`` as numpy, without torch (stored values: bf16/fp8 as raw bits)."""
        return self.checkpoint.select_numpy(self.key, index)

    def __getitem__(self, index: Any) -> "torch.Tensor":
        import torch

        raw = self.checkpoint.select_numpy(self.key, index)
        if raw.size == 0:  # (numpy gives empty arrays zero strides; torch's own are the usual ones)
            return torch.empty(raw.shape, dtype=self.dtype)
        if any(s < 0 for s in raw.strides):  # (flipped dims; a copy has positive strides even where a dim is 1 long)
            raw = raw.copy(order="C")
        t = torch.from_numpy(raw)
        return t.view(self.dtype) if stored_dtype_by_name(self.dtype_name).bits else t

    def __repr__(self) -> str:
        return f"<TensorView {self.key!r} shape={list(self._shape)} dtype=torch.{self.dtype_name} at {self.path}>"


def index_to_box(index: Any, shape: tuple[int, ...]) -> tuple[Box, tuple[Any, ...]]:
    """The bounding box an index touches, and the index that picks the result out of it."""
    if not isinstance(index, tuple):
        index = (index,)
    if sum(i is Ellipsis for i in index) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:at] + (slice(None),) * fill + index[at + 1 :]
    if len(index) > len(shape):
        raise IndexError(f"too many indices ({len(index)}) for a tensor of {len(shape)} dims")
    index = index + (slice(None),) * (len(shape) - len(index))
    offset, size, post = [], [], []
    for i, n in zip(index, shape):
        if isinstance(i, slice):
            picked = range(*i.indices(n))
            step = picked.step
            if step < 0:  # the same indices read upwards, then flipped
                picked = picked[::-1]
            offset.append(picked.start if picked else 0)
            size.append(picked[-1] - picked.start + 1 if picked else 0)
            post.append(slice(None, None, step))
        elif isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            j = int(i) + n if i < 0 else int(i)
            if not 0 <= j < n:
                raise IndexError(f"index {i} is out of bounds for a dim of size {n}")
            offset.append(j)
            size.append(1)
            post.append(0)
        else:
            raise TypeError(f"unsupported index {i!r}: use ints, slices and ...")
    return Box(tuple(offset), tuple(size)), tuple(post)


def _spans(offset: int, size: int, step: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """The indices ``offset, offset + step, ... < offset + size`` grouped by chunk, as
    ``(first, extent, position in the result, count)``."""
    out: list[tuple[int, int, int, int]] = []
    pos = 0
    i, stop = offset, offset + size
    while i < stop:
        end = min(stop, (i // chunk + 1) * chunk)
        count = -(-(end - i) // step)
        last = i + (count - 1) * step
        out.append((i, last - i + 1, pos, count))
        pos += count
        i += count * step
    return out


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (the checkpoint's repr, the CLI and the Jupyter HTML)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def commit_meta(store: Store, hmac_key: bytes | None = None) -> tuple[Store, CheckpointMeta]:
    """The committed store at ``store`` (:func:`~ucp_zarr.protocol.transaction.committed_store`)
    and its commit record, its signature verified with ``hmac_key``. The record is read
    without asking first whether it exists (one request, not two, on an object store)."""
    try:
        raw = store.read(METADATA_FILE)
    except FileNotFoundError:  # (no record here: an overwrite being put in place, or no checkpoint)
        store = committed_store(store)
        raw = store.read(METADATA_FILE)
    where = f"{store.url}/{METADATA_FILE}"
    doc = parse_document(raw, where, unique_keys=hmac_key is not None)
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    attrs = attrs.get(ATTRIBUTE) if isinstance(attrs, dict) else None
    if hmac_key is not None and isinstance(attrs, dict):  # (the signature first: it covers the record digest;
        check_signature(attrs, hmac_key, where)          # without attributes the document is no checkpoint)
    return store, CheckpointMeta.from_zarr_json(doc, where)


def open_reader(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None, hmac_key: bytes | None = None
) -> CheckpointReader:
    """The committed checkpoint at ``path`` (a local path or URL), read-only (see :func:`ucp_zarr.open`)."""
    return open_store_reader(open_store(path, storage_options), hmac_key)


def open_store_reader(store: Store, hmac_key: bytes | None = None, *, shared: bool = False) -> CheckpointReader:
    """The committed checkpoint in ``store``; ``shared``: other processes (the ranks of one
    job) read it at the same time (:meth:`.Store.share_reads`)."""
    if shared:
        store.share_reads()
    return CheckpointReader(*commit_meta(store, hmac_key), hmac_key, origin=store)
