"""What every converter shares: the imported form, safe unpickling, atomic output folders,
reading ahead for exports."""

from __future__ import annotations

import ctypes
import functools
import mmap as mmap_module
import os
import pickle
import re
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterable, Iterator, TypeVar

import torch

from ..errors import ConversionError, Keyword, UntrustedInputError
from ..format.safe_paths import inside
from ..format.statedict import Structure
from ..io.local import exchange_paths, fsync_dir
from ..io.store import Store, in_order
from ..protocol.writer import TensorSource

if TYPE_CHECKING:
    from ..protocol.reader import CheckpointReader

T = TypeVar("T")
R = TypeVar("R")

AHEAD_BYTES = 4 << 20
"""An export reads the parts of up to this size ahead of the one it writes (see :func:`read_ahead`)."""


def read_ahead(
    store: Store | None, read: Callable[[T], R], parts: Iterable[T], nbytes: Callable[[T], int]
) -> Generator[R | None, None, None]:
    """For each of ``parts`` in order, ``read(part)`` when it is at most :data:`AHEAD_BYTES`
    (read ahead, as many at once as ``store``, where they come from, keeps requests in
    flight: an object store, where each read is a round trip or two; at most twice that many
    ahead, 128 MiB at 16), else None: the caller reads a larger part as it writes it. Close
    it (``contextlib.closing``) when stopping early."""
    if store is None:
        yield from (None for _ in parts)
        return
    yield from in_order(store, lambda part: read(part) if nbytes(part) <= AHEAD_BYTES else None, parts)


@dataclass
class Imported:
    """A foreign checkpoint as the writer takes it: consolidated tensors (flattened key ->
    lazy source), JSON-able values, what the root's ``layout`` records about it, and tied
    tensors (alias key -> the key of ``tensors`` it reads: stored once)."""

    tensors: dict[str, TensorSource] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    ties: dict[str, str] = field(default_factory=dict)
    structure: Structure | None = None
    """How the source's state dict nested, where it records that (``read_state_dict`` gives
    it back so); None: flat keys."""


def export_keys(ck: "CheckpointReader", keys: Iterable[str] | None, holds: str) -> list[str]:
    """The keys an export of ``ck`` writes: ``keys`` (tensors, tied names, values), by default
    every one. Refused: a key the checkpoint lacks, and per-rank state (one copy per saving
    rank), which a format that ``holds`` one tensor or value per key cannot hold."""
    meta = ck.meta
    keys = [*meta.tensors, *meta.ties, *meta.values, *meta.rank_values] if keys is None else list(keys)
    unknown = [k for k in keys if meta.canonical(k) not in meta.tensors and k not in meta.values and k not in meta.rank_values]
    if unknown:
        raise ConversionError(f"no tensor or value {unknown} in checkpoint {ck.store.url}")
    per_rank = [k for k in keys if k in meta.rank_values or (k in meta.tensors and meta.tensors[k].ranks is not None)]
    if per_rank:
        raise ConversionError(
            f"{per_rank} are per-rank state (one copy per saving rank); {holds} one tensor or value per key: export "
            "the other keys by naming them in ", Keyword("keys"),
        )
    return keys


def prefix_key(prefix: str) -> str | None:
    """The mapping key a conversion's ``prefix`` nests the source under, for the nesting it
    records: ``""`` without a prefix, ``"a"`` for ``"a."``; None for a prefix that is no
    key (``"student_"``: the keys stay flat)."""
    if not prefix:
        return ""
    return prefix[:-1] if prefix.endswith(".") else None


class Opaque:
    """A foreign Python object read without running its code: the class it names, and the
    arguments and state its pickle holds (DeepSpeed's loss scaler, a named tuple, an enum).

    :func:`torch_load` makes one subclass per allowed class name, so that torch's
    weights-only unpickler accepts the name and builds this record instead of the class."""

    cls = ""
    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> "Opaque":
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque({self.cls}, args={self.args!r}, state={self.state!r})"

    def to_value(self) -> Any:
        """As JSON-able data: ``{"class": ..., "args": [...], "state": ...}``."""
        return {"class": self.cls, "args": [plain(a) for a in self.args], "state": plain(self.state)}


def plain(v: Any) -> Any:
    """``v`` with :class:`Opaque` records as dicts, small tensors as lists, dtypes and devices
    as their names (``"torch.float16"``: DeepSpeed's fp16 loss scaler holds one) (for JSON)."""
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    if isinstance(v, Opaque):
        return v.to_value()
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if type(v) is tuple:  # (a tuple stays one: Adam's betas)
        return tuple(plain(x) for x in v)
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, torch.Tensor):
        return v.tolist() if v.numel() <= 64 else f"<tensor {list(v.shape)} {v.dtype}>"
    if hasattr(v, "__dict__") and not isinstance(v, type):  # an object of a trusted file: the same record
        cls = type(v)
        return {"class": f"{cls.__module__}.{cls.__qualname__}", "args": [], "state": plain(vars(v))}
    return v


def _spells_int(key: Any) -> bool:
    return isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key) is not None


def int_key(key: Any) -> Any:
    """``key`` as the integer it spells (:func:`plain` keys every mapping by text), else as is."""
    return int(key) if _spells_int(key) else key


def int_keys(v: Any) -> Any:
    """``v`` (made by :func:`plain`) with each mapping whose keys all spell integers keyed by
    the integers again: a ``MultiStepLR``'s milestones, for a reader with no live object to
    take the key types from."""
    if isinstance(v, dict):
        ints = bool(v) and all(map(_spells_int, v))
        return {(int(k) if ints else k): int_keys(x) for k, x in v.items()}
    if isinstance(v, list):
        return [int_keys(x) for x in v]
    if type(v) is tuple:
        return tuple(int_keys(x) for x in v)
    return v


def _opaque_class(qual: str) -> type:
    module, _, name = qual.rpartition(".")
    return type(name, (Opaque,), {"__module__": module, "__qualname__": name, "cls": qual})


def torch_load(path: Path, *, trust: bool, opaque: Iterable[str] = (), mmap: bool = True) -> Any:
    """``torch.load`` of a foreign file without running code from it, unless ``trust``
    (see :func:`torch_load_mapped`)."""
    return torch_load_mapped(path, trust=trust, opaque=opaque, mmap=mmap)[0]


def torch_load_mapped(path: Path, *, trust: bool, opaque: Iterable[str] = (), mmap: bool = True) -> tuple[Any, bool]:
    """``torch.load`` of a foreign file without running code from it, unless ``trust``;
    returns the object and whether its tensors are memory-mapped from the file.

    Untrusted, torch's weights-only unpickler rebuilds tensors, containers and primitives,
    and the classes named in ``opaque`` (``"module.Name"``) as :class:`Opaque` records
    (nothing is imported, none of their code runs); any other global is refused.
    Memory-mapped where the file format allows, so tensors are read only when used (and
    their pages can be dropped after use, :func:`release_pages`).

    Raises :class:`UntrustedInputError` naming the file and the global it needs, and
    :class:`ConversionError` for a missing, truncated or unreadable file."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    stubs = [_opaque_class(q) for q in opaque]

    def load(use_mmap: bool) -> Any:
        if trust:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=use_mmap)
        with torch.serialization.safe_globals(stubs):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap)

    try:
        try:
            return load(mmap), mmap
        except RuntimeError as e:
            if mmap and "mmap" in str(e):  # the legacy (non-zip) format cannot be memory-mapped
                return load(False), False
            raise
    except pickle.UnpicklingError as e:
        if trust:
            raise ConversionError(f"{path}: cannot be unpickled: {e}") from None
        if "Unsupported operand" in str(e):  # (torch's weights-only unpickler met bytes no pickle holds)
            raise ConversionError(f"{path}: not a torch file, or a damaged one (it is no pickle a load can read)") from None
        raise UntrustedInputError(
            f"{path} holds Python objects that a weights-only load refuses ({_first_line(e)}); reading it "
            "runs code from the file: pass ", Keyword("trust", True), " only if you trust where it came from",
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ConversionError(f"{path}: unreadable or truncated torch file: {_first_line(e)}") from None


_MADV_DONTNEED = 4


@functools.lru_cache(maxsize=1)
def _madvise() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # not Linux
        return None


def release_pages(t: torch.Tensor) -> None:
    """Drop the resident pages of ``t``, a slice of a tensor memory-mapped read-only from a
    file by :func:`torch_load_mapped` (never call it on other memory): they are read again
    from the file if needed, so streaming a checkpoint does not grow the resident memory by
    its size. A no-op off Linux."""
    madvise = _madvise()
    if madvise is None or t.numel() == 0:
        return
    page = mmap_module.PAGESIZE
    lo = (t.data_ptr() + page - 1) // page * page  # whole pages inside the slice only
    hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if hi > lo:
        madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextmanager
def atomic_folder(dst: Path, *, overwrite: bool, ours: Callable[[str], bool], what: str) -> Iterator[Path]:
    """A temporary sibling of ``dst`` to write into, renamed to ``dst`` when the block
    succeeds: an interrupted export leaves no complete-looking ``dst`` (only a
    ``.<name>.partial-*`` sibling, removed on failure). An existing ``dst`` is refused
    unless ``overwrite``, and even then unless each of its entries is one ``ours`` claims
    (by name: what an export ``what`` writes), so that only an earlier export is replaced
    (after the new folder is complete), never a folder holding anything else (checkpoints,
    the source itself)."""
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise ConversionError(f"{dst} already exists; pass ", Keyword("overwrite", True), " to replace it")
        if dst.is_symlink() or not dst.is_dir():
            raise ConversionError(f"{dst} is not a folder; not replacing it with {what}")
        others = sorted(e.name for e in dst.iterdir() if not ours(e.name))
        if others:
            raise ConversionError(
                f"{dst} holds {others[:5]}{' ...' if len(others) > 5 else ''}, which {what} does not write: not "
                "replacing it (overwrite replaces only an earlier export); choose a new or empty folder"
            )
    tmp = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_tree(tmp)
        if dst.exists():
            old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:12]}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(dst: Path, *, overwrite: bool) -> Iterator[Path]:
    """A temporary sibling file of ``dst`` to write, made durable and renamed to ``dst`` when
    the block succeeds (an interrupted export leaves at most a ``.<name>.partial-*``
    sibling, removed on failure). An existing ``dst`` is refused unless ``overwrite``."""
    dst = Path(dst)
    if dst.is_dir():
        raise ConversionError(f"{dst} is a folder; give a file name (or a folder name without the .safetensors suffix)")
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise ConversionError(f"{dst} already exists; pass overwrite=True to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex[:12]}"
    try:
        yield tmp
        fsync_dir(tmp)
        os.replace(tmp, dst)  # (replaces a link itself, never writes through it)
        fsync_dir(dst.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_update(dst: Path, *, replaced: Callable[[str], bool], overwrite: bool) -> Iterator[Path]:
    """A temporary sibling folder to write the new files of the folder ``dst`` into; when the
    block succeeds, every entry of ``dst`` that ``replaced`` does not claim (``config.json``,
    a tokenizer) and the block did not write itself (an updated ``config.json``) is added to
    it (hard links, else copies; links as links), and the two
    folders are exchanged in one ``renameat2(RENAME_EXCHANGE)``, so that ``dst`` holds the
    old files or the new set, never a mix, whenever the process stops. (Where the file
    system cannot exchange, ``dst`` is renamed aside and the new folder renamed in: a crash
    between the two renames leaves the old folder as ``.<name>.old-*`` beside it.) Files
    of ``dst`` that ``replaced`` claims (earlier weights) are refused unless ``overwrite``;
    files added to ``dst`` while the block runs are lost."""
    dst = Path(dst)
    if dst.is_symlink() or dst.exists() and not dst.is_dir():
        raise ConversionError(f"{dst} is not a folder")
    clash = sorted(n for n in os.listdir(dst) if replaced(n)) if dst.exists() else []
    if clash and not overwrite:
        raise ConversionError(f"{dst} already holds {clash[:5]}; pass overwrite=True to replace them")
    tmp = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if dst.exists():
            for name in sorted(os.listdir(dst)):
                if not replaced(name) and not os.path.lexists(tmp / name):  # (one the block rewrote: its copy)
                    _link_tree(dst / name, inside(tmp, name, f"the file {name!r} of {dst}", write=True))
        _fsync_tree(tmp)
        if not dst.exists():
            os.rename(tmp, dst)
        elif not exchange_paths(tmp, dst):
            old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:12]}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            tmp = old
        fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # (now the old folder)


def _link_tree(src: Path, dst: Path) -> None:
    """``src`` (a file, link or folder) at ``dst``: files hard-linked (copied where links
    cannot be made), links re-created as links (not followed), folders recursively."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        dst.mkdir()
        for name in sorted(os.listdir(src)):
            _link_tree(src / name, dst / name)
    else:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            if not os.path.islink(os.path.join(dirpath, name)):
                fsync_dir(Path(dirpath, name))
        fsync_dir(Path(dirpath))
