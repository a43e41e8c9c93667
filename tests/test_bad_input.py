"""Bad input gets a clear error from ucp_zarr's own hierarchy, never anything else.

Property-based tests (hypothesis) over the metadata documents, the shard objects and the
public API (section 5 of the reliability issue). For every malformed input:

* ``open``, ``load``, ``ck[key][...]`` (whole, partial and stepped reads), ``ck.verify()``,
  ``ck.metadata``, ``repr(ck)`` and ``save`` either succeed -- only where the change is
  semantically harmless, and then with exactly the saved bits -- or raise a subclass of
  :class:`ucp_zarr.CheckpointError`; never another exception type;
* nothing is written outside the checkpoint's own directory (a reader writes nothing at all),
  and nothing beside the checkpoint is even read;
* nothing executes code: ``pickle.load(s)``, ``torch.load`` and ``numpy.load`` are replaced by
  functions that refuse, and audit hooks record any unpickling of a global, ``exec`` of code
  that is not a module being imported, and process creation;
* nothing hangs or allocates without bound.

Every example runs outside this process, in a process forked from it: reads of a checkpoint
in a long-lived reader worker (:class:`_Reader`, one job after another), saves and special
cases in a child forked for the example (:func:`isolated`). Either runs each job under an
address-space limit (``RLIMIT_AS``: its size plus ``ADDRESS_SPACE_HEADROOM``) and a wall-clock
limit (``EXAMPLE_TIMEOUT_S``, then SIGKILL), with unpickling refused and audit hooks on, and
reports each operation's outcome, the audit events it saw and how far its peak RSS rose
(``/proc/self/clear_refs`` + ``VmHWM``; at most ``MEMORY_GROWTH_LIMIT``). So a hang, a crash
or a runaway allocation fails one example instead of the run, and this process's own peak RSS
stays flat (the last test checks ``ru_maxrss``). Each example's checkpoint is a sandbox
restored from a template (:func:`sandbox`), next to canary files a path escaping it would reach.

The bugs these properties found (21, all fixed) stay pinned as explicit ``@example``\\ s of the
property that found them, and each has a minimal regression test: a ``test_bug_*`` test at the
end, or the small parametrized tests of section 5, which are minimal already; every one of them
failed before its fix.
``UCP_ZARR_BAD_INPUT_SCALE=10`` multiplies the number of examples (the default keeps this
module under a minute on two cores).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import pickle
import re
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import note as _hypothesis_note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import ucp_zarr
from ucp_zarr import CheckpointError, CorruptChunkError, FormatError
from ucp_zarr.format.integrity import RECORD_DIGEST, record_digest
from ucp_zarr.format.statedict import iter_leaves

pytestmark = [
    pytest.mark.skipif(
        not (sys.platform.startswith("linux") and hasattr(os, "fork")),
        reason="each example runs in a forked child process with resource limits (Linux)",
    ),
    # (Python >= 3.12 warns on fork() while torch's native threads exist; the children run no
    # code that could wait on a lock held by one of them: they start their own threads)
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
]

# --- limits ----------------------------------------------------------------------------------

EXAMPLE_TIMEOUT_S = 20.0
"""Wall-clock limit of one example's job (normal ones take 20-200 ms): past it, a hang."""
MEMORY_GROWTH_LIMIT = 256 << 20
"""How far a job may raise its process's peak RSS above its RSS at the start."""
ADDRESS_SPACE_HEADROOM = 2 << 30
"""RLIMIT_AS of a job: its process's address space at the start plus this."""
CHUNK_BYTES = 64
SHARD_BYTES = 256
HMAC_KEY = b"the key of the signed checkpoint"
ROOT = ("attributes", "ucp_zarr")
_COMPONENT = re.compile(r"[A-Za-z0-9_%~\-][A-Za-z0-9_.%~\-]*")
"""A path component ucp_zarr may create (schema/FORMAT.md: escaped names; ``~n`` suffixes)."""


SCALE = float(os.environ.get("UCP_ZARR_BAD_INPUT_SCALE", "1"))
"""Multiplies every property's number of examples (the defaults keep the module under a minute
on two cores, where one example costs 20-70 ms; a nightly run may pass 10)."""


def _settings(n: int, **kw: Any) -> settings:
    """``n`` examples (times SCALE), no deadline (the isolation enforces EXAMPLE_TIMEOUT_S
    with SIGKILL)."""
    return settings(
        max_examples=max(1, round(n * SCALE)),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        **kw,
    )


def note(message: str) -> None:
    """hypothesis.note where a property runs (shown with a falsifying example), else nothing."""
    if currently_in_test_context():
        _hypothesis_note(message)


# --- the saved state ---------------------------------------------------------------------------


def make_state(template: bool = False) -> dict[str, Any]:
    """The base checkpoint's state dict (``template``: the same keys, zeros and placeholders,
    to load into). Small tensors of several dtypes, a 0-d and an empty one, per-rank state,
    nested JSON values with tag-like keys, bytes, non-finite floats and tuples."""
    g = torch.Generator().manual_seed(1234)

    def t(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x) if template else x

    def v(x: Any) -> Any:
        return "placeholder" if template else x

    return {
        "model": {
            "layers.0.weight": t(torch.randn(16, 12, generator=g)),
            "layers.0.bias": t(torch.randn(12, generator=g).bfloat16()),
            "scale": t(torch.tensor(3.25)),
            "ids": t(torch.arange(-20, 20, dtype=torch.int32)),
            "mask": t(torch.rand(5, 3, generator=g) > 0.5),
            "empty": t(torch.empty(0, 7)),
        },
        "optim": {
            "state": {"layers.0.weight": {"exp_avg": t(torch.randn(16, 12, generator=g)), "step": t(torch.tensor(7.0))}},
            "param_groups": [{"lr": v(1e-3), "betas": v((0.9, 0.999)), "params": v(["layers.0.weight"]), "name": v("g0")}],
        },
        "rng": ucp_zarr.PerRank(t(torch.arange(8, dtype=torch.uint8))),
        "loader": ucp_zarr.PerRank({"epoch": v(1), "pos": v(17)}),
        "step": v(100),
        "extra": {
            "nested": [v(1), v(2.5), v(None), v("s"), {"deep": v([True, False])}],
            "blob": v(b"\x00\xffbytes"),
            "nan": v(float("nan")),
            "ninf": v(float("-inf")),
            "$tag": v("x"),
            "tup": v((1, (2, "3"))),
        },
    }


def _unwrap(value: Any) -> Any:
    return value.value if isinstance(value, ucp_zarr.PerRank) else value


ORIGINAL_TENSORS: dict[str, torch.Tensor] = {}
ORIGINAL_VALUES: dict[str, Any] = {}
for _leaf in iter_leaves(make_state()):
    _value = _unwrap(_leaf.value)
    (ORIGINAL_TENSORS if isinstance(_value, torch.Tensor) else ORIGINAL_VALUES)[_leaf.key] = _value


def _holds_data(key: str) -> bool:
    """Whether loading ``key`` reads anything (an empty tensor reads no document, no shard)."""
    return ORIGINAL_TENSORS[key].numel() > 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bits(a), _bits(b))


def _same_value(a: Any, b: Any) -> bool:
    """Equal values of the same types at every depth (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return _same_tensor(a, b)
    return a == b


# --- the base checkpoints (saved once per module) ----------------------------------------------


@dataclass
class Base:
    peak_rss_at_start: int
    scratch: Path
    unsigned: Path
    twin: Path
    """Another save of the same state dict: same bytes of data, another save id."""
    signed: Path
    docs: dict[str, Any] = field(default_factory=dict)
    """Parsed documents: "root", "signed_root", and every array document by relative path."""
    raw: dict[str, bytes] = field(default_factory=dict)
    array_docs: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    """Array document path -> (tensor key, per-rank copy's rank)."""
    shards: list[tuple[str, str, str]] = field(default_factory=list)
    """(shard object path, its array document path, tensor key)."""
    _paths: dict[Any, list[tuple[Any, ...]]] = field(default_factory=dict)

    def paths(self, doc: str, prefixes: tuple[tuple[Any, ...], ...], kind: str,
              exact: tuple[tuple[Any, ...], ...] = ()) -> list[tuple[Any, ...]]:
        """JSON paths into document ``doc`` under any of ``prefixes`` or equal to one of
        ``exact``: every node (``kind="node"``), every node but the prefix (``"member"``) or
        every container."""
        k = (doc, prefixes, kind, exact)
        if k not in self._paths:
            out = []
            for path in _json_paths(self.docs[doc]):
                if path not in exact and not any(path[: len(p)] == p for p in prefixes):
                    continue
                node = _get(self.docs[doc], path)
                if kind == "member" and (path in prefixes or not path):
                    continue
                if kind == "container" and not isinstance(node, (dict, list)):
                    continue
                out.append(path)
            self._paths[k] = sorted(out, key=repr)
        return self._paths[k]


_BASE: Base | None = None


def base() -> Base:
    assert _BASE is not None, "the module fixture saves the base checkpoints first"
    return _BASE


@pytest.fixture(scope="module", autouse=True)
def base_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Base]:
    global _BASE
    scratch = tmp_path_factory.mktemp("bad_input")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    b = Base(peak, scratch, scratch / "base" / "ck", scratch / "base" / "twin", scratch / "base" / "signed")
    for path, key in ((b.unsigned, None), (b.twin, None), (b.signed, HMAC_KEY)):
        ucp_zarr.save(make_state(), path, chunk_bytes=CHUNK_BYTES, shard_bytes=SHARD_BYTES, hmac_key=key)
    b.raw["root"] = (b.unsigned / "zarr.json").read_bytes()
    b.docs["root"] = json.loads(b.raw["root"])
    b.docs["signed_root"] = json.loads((b.signed / "zarr.json").read_bytes())
    for key, entry in b.docs["root"]["attributes"]["ucp_zarr"]["tensors"].items():
        copies = [(int(r), ref["path"]) for r, ref in entry.get("ranks", {}).items()] or [(None, entry["path"])]
        for rank, path in copies:
            doc = f"{path}/zarr.json"
            b.array_docs[doc] = (key, rank)
            b.raw[doc] = (b.unsigned / doc).read_bytes()
            b.docs[doc] = json.loads(b.raw[doc])
            for dirpath, _, files in os.walk(b.unsigned / path / "c"):
                for f in files:
                    b.shards.append((os.path.relpath(os.path.join(dirpath, f), b.unsigned), doc, key))
            if not os.path.isdir(b.unsigned / path / "c") and (b.unsigned / path / "c").exists():
                b.shards.append((f"{path}/c", doc, key))  # a 0-d array's one shard object
    b.shards.sort()
    assert len(b.shards) >= 8 and any(doc.startswith("rng/") for doc in b.array_docs)
    _BASE = b
    # Warm up in this process: everything the reads import lazily is imported before any
    # child runs (so that a child's audit log holds no imports), on good and bad input.
    _warm_up(b)
    yield b
    _READER.stop()
    _BASE = None


def _warm_up(b: Base) -> None:
    results: list[dict[str, Any]] = []
    exercise_reader(b.unsigned, results)
    exercise_reader(b.signed, results, key=HMAC_KEY)
    assert all(r["outcome"] == "ok" for r in results if r["op"] != "wrong-key open"), results
    with sandbox(b.unsigned) as (box, ck):
        shard = ck / b.shards[0][0]
        shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
        doc = ck / next(iter(b.array_docs))
        doc.write_bytes(doc.read_bytes() + b" ")
        exercise_reader(ck, [])
        (ck / "zarr.json").write_bytes(b"{")
        exercise_reader(ck, [])
        exercise_reader(box / "nothing", [])
    from ucp_zarr.format.documents import ArrayMeta

    for name in ("not a document", {"zarr_format": 3, "node_type": "array"}):
        with contextlib.suppress(CheckpointError):
            ArrayMeta.from_zarr_json(name, "warm-up")
    with contextlib.suppress(Exception):
        ucp_zarr.save({"x": object()}, b.scratch / "warm-up-failed-save")
    traceback.format_exception(ValueError("warm-up"))


@contextlib.contextmanager
def sandbox(source: Path | None = None) -> Iterator[tuple[Path, Path]]:
    """A directory ``box`` holding ``box/ck`` (an exact copy of ``source``, or nothing) beside
    canaries that a path escaping the checkpoint would reach: ``box/secret``,
    ``box/zarr.json``, ``box/canary/zarr.json``.

    One box per source is reused: on entry it is brought back to its template by comparing
    every entry (type, size, mtime) and restoring only what differs -- ~1 ms instead of a
    ~12 ms copy per example. Nothing runs against a box after its example returned (the
    worker answered, or was killed; a forked child was waited for)."""
    name = "none" if source is None else source.name
    template = base_scratch() / "templates" / name
    box = base_scratch() / "boxes" / name
    if not template.exists():
        tmp = template.with_name(template.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if source is not None:
            shutil.copytree(source, tmp / "ck")
        (tmp / "secret").write_text("secret")
        (tmp / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
        (tmp / "canary").mkdir()
        (tmp / "canary" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
        tmp.rename(template)
        _TEMPLATES[template] = _entries(template)
    _restore(box, template)
    yield box, box / "ck"


_TEMPLATES: dict[Path, dict[str, tuple[int, int, int]]] = {}


def _entries(root: Path | str, prefix: str = "", out: dict[str, tuple[int, int, int]] | None = None
             ) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root`` by relative path: (file type, size, mtime) -- for
    directories only the type. Symbolic links are not followed."""
    out = {} if out is None else out
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for e in entries:
        st_ = e.stat(follow_symlinks=False)
        kind = stat.S_IFMT(st_.st_mode)
        rel = prefix + e.name
        if kind == stat.S_IFDIR:
            out[rel] = (kind, 0, 0)
            _entries(e.path, rel + os.sep, out)
        else:
            out[rel] = (kind, st_.st_size, st_.st_mtime_ns)
    return out


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def _restore(box: Path, template: Path) -> None:
    """Make ``box`` an exact copy of ``template`` again, touching only what differs."""
    want = _TEMPLATES[template]
    box.mkdir(parents=True, exist_ok=True)
    have = _entries(box)
    for rel in sorted(set(have) - set(want), key=len, reverse=True):
        _remove(os.path.join(box, rel))
    for rel in sorted(want):
        if have.get(rel) == want[rel] and os.path.lexists(os.path.join(box, rel)):
            continue
        dst = os.path.join(box, rel)
        if want[rel][0] == stat.S_IFDIR:
            if os.path.lexists(dst) and not stat.S_ISDIR(os.lstat(dst).st_mode):
                os.unlink(dst)
            os.makedirs(dst, exist_ok=True)
        else:
            _remove(dst)
            shutil.copy2(os.path.join(template, rel), dst)  # (keeps the mtime the template has)
    assert _entries(box) == want, "the sandbox could not be restored"


def base_scratch() -> Path:
    return base().scratch if _BASE is not None else Path(tempfile.gettempdir())


# --- isolation: one forked child per example ---------------------------------------------------


class Violation(AssertionError):
    """A successful operation broke a property (wrong data, success where refusal is due)."""


class _Forbidden(BaseException):
    """Raised by the replaced unpickling functions (a BaseException: no ``except Exception``
    in the library can swallow it)."""


_AUDIT: dict[str, Any] = {"log": None, "watch": None}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_MUTATING: dict[str, tuple[tuple[int, int | None], ...]] = {
    # event -> (index of a path argument, index of the dir_fd it is relative to)
    "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),), "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "shutil.rmtree": ((0, 1),), "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.mkfifo": ((0, 2),), "os.mknod": ((0, 3),),
    "shutil.copyfile": ((0, None), (1, None)), "shutil.copytree": ((0, None), (1, None)), "shutil.move": ((0, None), (1, None)),
}


def _resolve(path: Any, dir_fd: Any) -> str | None:
    """The absolute path an audited call acts on (``dir_fd``-relative names resolved
    through /proc, as shutil.rmtree uses them)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return None
    path = os.fsdecode(path)
    if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
        try:
            return os.path.normpath(os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path))
        except OSError:
            return f"<fd {dir_fd}>/{path}"
    return os.path.abspath(path)


_EXECUTING = {"pickle.find_class", "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    log = _AUDIT["log"]
    if log is None:
        return
    if event == "open":
        path, _, flags = args
        if isinstance(path, int):
            return
        path = os.path.abspath(os.fsdecode(path))
        if isinstance(flags, int) and flags & _WRITE_FLAGS:
            if "__pycache__" not in path:  # an import compiling a module
                log.append(["write", event, path])
        elif path.startswith(_AUDIT["watch"]):
            log.append(["read", event, path])
    elif event in _MUTATING:
        for i, fd in _MUTATING[event]:
            p = _resolve(args[i] if i < len(args) else None, args[fd] if fd is not None and fd < len(args) else None)
            if p is not None and "__pycache__" not in p:
                log.append(["write", event, p])
    elif event in _EXECUTING:
        log.append(["execute", event, repr(args)[:200]])
    elif event == "exec":
        name = getattr(args[0], "co_filename", "")
        if name.startswith("<") and not _importing():
            log.append(["execute", event, name])


def _importing() -> bool:
    f: Any = sys._getframe(2)
    while f is not None:
        if "importlib._bootstrap" in f.f_code.co_filename or "<frozen importlib" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def _refuse(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        log = _AUDIT["log"]
        if log is not None:
            log.append(["execute", name, "called"])
        raise _Forbidden(f"{name} was called: ucp_zarr must never unpickle")

    return refuse


@contextlib.contextmanager
def no_unpickling() -> Iterator[None]:
    """Replace every unpickling entry point by a function that refuses (restored after)."""
    targets = [(pickle, "load"), (pickle, "loads"), (torch, "load"), (torch.serialization, "load"), (np, "load")]
    saved = [(m, n, getattr(m, n)) for m, n in targets]
    for m, n in targets:
        setattr(m, n, _refuse(f"{m.__name__}.{n}"))
    try:
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


def _statm() -> tuple[int, int]:
    with open("/proc/self/statm") as f:
        vsz, rss = f.read().split()[:2]
    page = os.sysconf("SC_PAGE_SIZE")
    return int(vsz) * page, int(rss) * page


def _reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS, which is returned (where the
    kernel does not allow the reset, the peak so far: then only a new peak counts)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return _status("VmHWM")
    return _status("VmRSS")


def _peak_rss() -> int:
    return _status("VmHWM")


def _status(field_: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field_}:\s+(\d+) kB", f.read()).group(1)) * 1024


@dataclass
class Report:
    results: list[dict[str, Any]]
    events: list[list[str]]
    hung: bool
    signal: int | None
    growth: int
    wall_s: float
    crash: str | None

    def outcome(self, op: str) -> dict[str, Any] | None:
        return next((r for r in self.results if r["op"] == op), None)

    def ops(self, prefix: str) -> list[dict[str, Any]]:
        return [r for r in self.results if r["op"].startswith(prefix)]


def isolated(work: Callable[[list[dict[str, Any]]], None], *, watch: Path, timeout: float = EXAMPLE_TIMEOUT_S,
             headroom: int = ADDRESS_SPACE_HEADROOM) -> Report:
    """Run ``work(results)`` in a forked child under RLIMIT_AS and a wall-clock limit, with
    unpickling refused and audit events recorded (reads only under ``watch``)."""
    vsz, rss = _statm()
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            # intra-op work inline: an OpenMP pool the parent started (any earlier test's large
            # tensor op in this process) does not survive fork, and entering it would hang
            torch.set_num_threads(1)
            os.close(r)
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            limit = vsz + headroom
            if hard != resource.RLIM_INFINITY:
                limit = min(limit, hard)
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
            baseline = _reset_peak_rss()
            results: list[dict[str, Any]] = []
            events: list[list[str]] = []
            crash = None
            _AUDIT["watch"] = os.path.abspath(watch)
            sys.addaudithook(_audit)
            with no_unpickling():
                _AUDIT["log"] = events
                try:
                    work(results)
                except BaseException as e:  # the harness's own failure
                    crash = _describe(e)
                _AUDIT["log"] = None
            growth = _peak_rss() - baseline
            payload = json.dumps({"results": results, "events": events[:100], "crash": crash, "growth": growth}, default=repr)
            data = payload.encode()
            while data:
                data = data[os.write(w, data) :]
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    hung = False
    deadline = t0 + timeout
    with os.fdopen(r, "rb", buffering=0) as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                hung = True
                os.kill(pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([f], [], [], min(left, 1.0))
            if ready:
                chunk = f.read(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) and not hung else None
    try:
        payload = json.loads(b"".join(chunks)) if chunks else {}
    except ValueError:
        payload = {}
    crash = payload.get("crash")
    if not hung and sig is None and not payload:
        crash = f"the child exited with status {status} and no report"
    # the child's own measure (peak over its RSS after the fork); else what wait4 says
    growth = payload.get("growth", usage.ru_maxrss * 1024 - rss)
    return Report(payload.get("results", []), payload.get("events", []), hung, sig, growth, wall, crash)


class _Reader:
    """A worker process forked from this one that runs reader jobs (:func:`exercise_reader`)
    one after another -- ~2x cheaper than a fork per example -- under the same limits: before
    each job its RLIMIT_AS is set to its size plus the headroom and its peak RSS is reset
    (``/proc/self/clear_refs``), and a job that does not answer within its timeout gets the
    worker killed (then reported as a hang; the next job forks a new worker). Jobs and
    results travel as JSON lines, never pickled."""

    pid: int | None = None
    to_worker: int = -1
    from_worker: Any = None

    def start(self) -> None:
        jr, jw = os.pipe()
        rr, rw = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(jw)
                os.close(rr)
                _serve(jr, rw)
            except BaseException:
                code = 70
            finally:
                os._exit(code)
        os.close(jr)
        os.close(rw)
        self.pid, self.to_worker, self.from_worker = pid, jw, os.fdopen(rr, "rb", buffering=0)

    def stop(self) -> None:
        if self.pid is None:
            return
        with contextlib.suppress(OSError):
            os.close(self.to_worker)
        with contextlib.suppress(OSError):
            self.from_worker.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self.pid = None

    def run(self, job: dict[str, Any], timeout: float) -> Report:
        if self.pid is None:
            self.start()
        t0 = time.monotonic()
        line = b""
        try:
            os.write(self.to_worker, json.dumps(job).encode() + b"\n")
            while not line.endswith(b"\n"):
                left = t0 + timeout - time.monotonic()
                if left <= 0 or not select.select([self.from_worker], [], [], left)[0]:
                    raise TimeoutError
                chunk = self.from_worker.read(1 << 16)
                if not chunk:
                    raise EOFError
                line += chunk
        except TimeoutError:
            self.stop()
            return Report([], [], True, None, 0, time.monotonic() - t0, None)
        except (EOFError, OSError):
            pid = self.pid
            self.stop()
            return Report([], [], False, None, 0, time.monotonic() - t0, f"the reader worker {pid} died")
        out = json.loads(line)
        return Report(out["results"], out["events"], False, None, out["growth"], time.monotonic() - t0, out["crash"])


def _serve(jobs_fd: int, results_fd: int) -> None:
    """The reader worker's loop (see :class:`_Reader`)."""
    sys.addaudithook(_audit)
    for m, n in [(pickle, "load"), (pickle, "loads"), (torch, "load"), (torch.serialization, "load"), (np, "load")]:
        setattr(m, n, _refuse(f"{m.__name__}.{n}"))
    jobs = os.fdopen(jobs_fd, "rb")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    for line in jobs:
        job = json.loads(line)
        vsz, rss = _statm()
        limit = vsz + job["headroom"]
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        rss = _reset_peak_rss()
        results: list[dict[str, Any]] = []
        events: list[list[str]] = []
        crash = None
        _AUDIT["watch"] = job["watch"]
        _AUDIT["log"] = events
        try:
            exercise_reader(Path(job["path"]), results, **_reader_kwargs(job["kwargs"]))
        except BaseException as e:
            crash = _describe(e)
        _AUDIT["log"] = None
        out = json.dumps({"results": results, "events": events[:100], "crash": crash, "growth": _peak_rss() - rss}, default=repr)
        data = out.encode() + b"\n"
        while data:
            data = data[os.write(results_fd, data) :]


def _reader_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """exercise_reader's keyword arguments from their JSON form."""
    out = dict(kw)
    if out.get("key") is not None:
        out["key"] = bytes.fromhex(out["key"])
    if "unindexed" in out:
        out["unindexed"] = frozenset(out["unindexed"])
    return out


_READER = _Reader()


def _describe(e: BaseException) -> str:
    tb = "".join(traceback.format_exception(e))
    return f"{type(e).__module__}.{type(e).__qualname__}: {str(e)[:300]}\n{tb[-1800:]}"


def attempt(results: list[dict[str, Any]], op: str, fn: Callable[[], Any]) -> Any:
    """Run one operation and record its outcome: ok, error (a CheckpointError), violation
    (a property broken by a success), forbidden (unpickling) or foreign (anything else)."""
    try:
        value = fn()
    except Violation as e:
        results.append({"op": op, "outcome": "violation", "detail": str(e)})
    except CheckpointError as e:
        results.append({"op": op, "outcome": "error", "type": type(e).__name__, "detail": str(e)[:300]})
    except _Forbidden as e:
        results.append({"op": op, "outcome": "forbidden", "detail": str(e)})
    except BaseException as e:
        results.append({"op": op, "outcome": "foreign", "type": type(e).__name__, "detail": _describe(e)})
    else:
        results.append({"op": op, "outcome": "ok"})
        return value
    return None


def problems_of(report: Report, *, box: Path, ck: Path, may_write: bool = False, staging: bool = False) -> list[str]:
    """Everything wrong with an isolated run, whatever the test expects of the outcomes:
    a hang, a crash, a runaway allocation, code execution, a write (anywhere for a reader,
    outside ``ck`` for a writer), a read beside the checkpoint, an exception outside the
    hierarchy, a success that returned wrong data."""
    out = []
    if report.hung:
        out.append(f"HANG: the job did not finish within its time limit ({report.wall_s:.1f} s; killed)")
    if report.signal is not None:
        out.append(f"CRASH: the child died of signal {signal.Signals(report.signal).name}")
    if report.crash:
        out.append(f"harness failure in the child: {report.crash}")
    if report.growth > MEMORY_GROWTH_LIMIT:
        out.append(f"MEMORY: peak RSS grew by {report.growth >> 20} MiB (limit {MEMORY_GROWTH_LIMIT >> 20} MiB)")
    inside = os.path.abspath(ck) + os.sep
    sibling = re.compile(re.escape(os.path.join(os.path.abspath(box), f".{ck.name}.ucp_zarr-")) + r"[0-9a-f]{32}(/|$)")
    for kind, event, path in report.events:
        if kind == "execute":
            out.append(f"CODE EXECUTION: {event} {path}")
        elif kind == "write":
            ok = may_write and ((path + os.sep).startswith(inside) or (staging and sibling.match(path)))
            if not ok:
                out.append(f"WRITE {'outside the checkpoint' if may_write else 'by a reader'}: {event} {path}")
        elif kind == "read" and path != os.path.abspath(box) and not (path + os.sep).startswith(inside) and not (
            staging and sibling.match(path)
        ):  # (the directory holding the checkpoint is opened to fsync its entries)
            out.append(f"READ OUTSIDE THE CHECKPOINT: {event} {path}")
    for r in report.results:
        if r["outcome"] in ("foreign", "violation", "forbidden"):
            out.append(f"{r['op']}: {r['outcome'].upper()} {r.get('type', '')}\n{r['detail']}")
    return out


def check(report: Report, *, box: Path, ck: Path, **kw: Any) -> None:
    __tracebackhide__ = True  # (pytest reports the caller's line)
    found = problems_of(report, box=box, ck=ck, **kw)
    note(f"outcomes: {[(r['op'], r['outcome'], r.get('type')) for r in report.results]}")
    if found:
        raise AssertionError("\n".join(found))


def expect(report: Report, op_prefix: str, *types: str, allow_ok: bool = False, exact: bool = False) -> None:
    """Every operation named ``op_prefix...`` (``exact``: named ``op_prefix``) raised one of
    ``types`` (or succeeded, if ``allow_ok``); at least one such operation ran."""
    __tracebackhide__ = True  # (pytest reports the caller's line)
    ops = [r for r in report.ops(op_prefix) if not exact or r["op"] == op_prefix]
    assert ops, f"no operation {op_prefix!r} ran: {report.results}"
    for r in ops:
        if r["outcome"] == "ok" and allow_ok:
            continue
        assert r["outcome"] == "error" and r["type"] in types, (
            f"{r['op']}: expected {' or '.join(types)}{' or success' if allow_ok else ''}, got {r['outcome']} "
            f"{r.get('type', '')}: {r.get('detail', '')[:400]}"
        )


def refused_at_open(report: Report) -> bool:
    """Whether ``open`` refused the commit record (a FormatError: it is malformed, or two of
    its entries contradict each other); then ``load`` must refuse it too."""
    __tracebackhide__ = True  # (pytest reports the caller's line)
    r = report.outcome("open")
    if r is None or r["outcome"] == "ok":
        return False
    expect(report, "open", "FormatError")
    expect(report, "load", "FormatError")
    return True


def expect_ok(report: Report, op: str) -> None:
    __tracebackhide__ = True  # (pytest reports the caller's line)
    r = report.outcome(op)
    assert r is not None and r["outcome"] == "ok", f"{op}: expected success, got {r}"


# --- what a reader does with a checkpoint ------------------------------------------------------


def _check_tensor(key: str, got: torch.Tensor, index: Any = None) -> None:
    want = ORIGINAL_TENSORS.get(key)
    if want is None:
        raise Violation(f"reading {key!r}, which was never saved, succeeded")
    if index is not None:
        want = want[index]
    if not _same_tensor(got, want):
        raise Violation(f"reading {key!r} succeeded with other data: {got!r} instead of {want!r}")


def _check_loaded(state: dict[str, Any], values_intact: bool, untouched_ok: frozenset[str] = frozenset()) -> None:
    """A loaded state dict holds the saved bits (``untouched_ok``: or, for these keys, the
    template's zeros) and, if ``values_intact``, the saved values."""
    for leaf in iter_leaves(state):
        value = _unwrap(leaf.value)
        if isinstance(value, torch.Tensor):
            if leaf.key in untouched_ok and not value.any():
                continue
            _check_tensor(leaf.key, value)
        elif values_intact and leaf.key in ORIGINAL_VALUES and not _same_value(value, ORIGINAL_VALUES[leaf.key]):
            raise Violation(f"load gave {leaf.key!r} = {value!r}, saved {ORIGINAL_VALUES[leaf.key]!r}")


STEPPED_READS = {"model.layers.0.weight", "model.ids"}
"""Keys read in part with a stepped slice (the others with a plain one)."""
PART_READS = STEPPED_READS | {"model.layers.0.bias", "model.scale", "model.empty", "rng"}
"""Keys also read in part (one of each kind of shape: 2-d, 1-d, 0-d, empty, per-rank)."""


def _part(shape: tuple[int, ...], stepped: bool) -> tuple[Any, ...]:
    if stepped:
        return tuple(slice(1, None, 2) if n > 2 else slice(0, max(n - 1, 0)) for n in shape)
    return tuple(slice(n // 3, max(n // 3 + 1, n - n // 4)) for n in shape)


def _read_part(ck: ucp_zarr.Checkpoint, key: str) -> None:
    """Part of a tensor (a stepped slice for STEPPED_READS), indexed by the shape the view reports."""
    view = ck[key]
    index = _part(tuple(view.shape), key in STEPPED_READS)
    got = view[index]
    if key in ORIGINAL_TENSORS and tuple(view.shape) != tuple(ORIGINAL_TENSORS[key].shape):
        raise Violation(f"reading part of {key!r} succeeded with shape {list(view.shape)}, saved "
                        f"{list(ORIGINAL_TENSORS[key].shape)}")
    _check_tensor(key, got, index)


def exercise_reader(path: Path, results: list[dict[str, Any]], *, key: bytes | None = None,
                    values_intact: bool = True, unindexed: frozenset[str] = frozenset(), nonstrict: bool = False) -> None:
    """Everything a reader may do with the checkpoint at ``path``, each step recorded
    (``nonstrict``: a non-strict load too, where the commit record's keys were changed)."""
    ck = attempt(results, "open", lambda: ucp_zarr.open(path, hmac_key=key))
    if key is None:
        attempt(results, "wrong-key open", lambda: ucp_zarr.open(path, hmac_key=b"wrong key"))
    if ck is not None:
        attempt(results, "metadata", lambda: ck.metadata)
        attempt(results, "repr", lambda: (repr(ck), ck._repr_html_()))
        for k in list(ck.keys()):
            attempt(results, f"read {k!r}", lambda k=k: _check_tensor(k, ck[k][...]))
            if k in PART_READS or k not in ORIGINAL_TENSORS:
                attempt(results, f"read part of {k!r}", lambda k=k: _read_part(ck, k))
            entry = ck.meta.tensors[k]
            for rank in sorted(entry.ranks or ()):
                attempt(results, f"read {k!r} rank {rank}", lambda k=k, r=rank: _check_tensor(k, ck.read(k, rank=r)))
        attempt(results, "verify", ck.verify)
    attempt(results, "load", lambda: _check_loaded(ucp_zarr.load(make_state(True), path, hmac_key=key), values_intact))
    if not nonstrict:
        return
    attempt(
        results,
        "load non-strict",
        lambda: _check_loaded(
            ucp_zarr.load(make_state(True), path, strict=False, allow_new_ranks=True, hmac_key=key, max_workers=1),
            values_intact,
            unindexed,
        ),
    )


def read_in_child(ck: Path, box: Path, *, timeout: float = EXAMPLE_TIMEOUT_S, headroom: int = ADDRESS_SPACE_HEADROOM,
                  **kw: Any) -> Report:
    """:func:`exercise_reader` on ``ck`` in the reader worker (see :class:`_Reader`)."""
    intact, unindexed = _what_changed(ck)
    kw.setdefault("values_intact", intact)
    kw["unindexed"] = sorted(kw.get("unindexed", unindexed))
    if kw.get("key") is not None:
        kw["key"] = kw["key"].hex()
    job = {"path": str(ck), "watch": os.path.abspath(box), "headroom": headroom, "kwargs": kw}
    return _READER.run(job, timeout)


def _what_changed(ck: Path) -> tuple[bool, frozenset[str]]:
    """What the commit record at ``ck`` (as ``json.loads`` reads it) changed: whether it
    still holds the saved non-tensor values (an unsigned checkpoint does not protect them: a
    load may return others, or with ``strict=False`` keep the placeholders), and which saved
    tensors it no longer indexes (a non-strict load leaves those untouched)."""
    try:
        if not stat.S_ISREG(os.lstat(ck / "zarr.json").st_mode):
            return True, frozenset()
        attrs = json.loads((ck / "zarr.json").read_bytes())["attributes"]["ucp_zarr"]
        want = base().docs["root"]["attributes"]["ucp_zarr"]
        intact = attrs["values"] == want["values"] and attrs["rank_values"] == want["rank_values"]
    except Exception:
        return True, frozenset()

    def restorable(key: str) -> bool:  # by rank 0, the rank every load here runs as
        try:
            entry = attrs["tensors"][key]
            if "ranks" not in entry:
                return True
            return any(_as_int(r) == 0 for r in entry["ranks"])
        except Exception:
            return False

    return intact, frozenset(k for k in ORIGINAL_TENSORS if not restorable(k))


def _as_int(s: Any) -> int | None:
    try:
        return int(s)
    except (TypeError, ValueError):
        return None


# --- JSON documents: paths and mutations ------------------------------------------------------


def _json_paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _json_paths(v, prefix + (i,))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


Mutation = tuple[str, tuple[Any, ...], Any]
"""(op, path, argument): ("replace", path, value), ("delete", path, None) or
("add", container path, (member name, value))."""


def apply(doc: Any, m: Mutation) -> Any:
    op, path, arg = m
    doc = copy.deepcopy(doc)
    if op == "replace":
        if not path:
            return arg
        _get(doc, path[:-1])[path[-1]] = arg
    elif op == "delete":
        if not path:
            return {}
        del _get(doc, path[:-1])[path[-1]]
    elif op == "add":
        node = _get(doc, path)
        if isinstance(node, dict):
            node[arg[0]] = arg[1]
        else:
            node.append(arg[1])
    else:
        raise AssertionError(op)
    return doc


HOSTILE_NAMES = [
    "", ".", "..", "../..", "../x", "../secret", "a/../../b", "/", "/etc/passwd", "//", "a//b", "\\", "a\\b",
    "..\\..\\x", "C:\\x", "~", "~/x", "~root", "\x00", "a\x00b", "\n", "\t\r\x1b[31m", "\u202e", "\ufeff",
    "\u0301", "é", "\U0001f600", "\ud800", "\udc80", "a\udfffb", ".ucp_zarr_pending", ".ucp_zarr_replace",
    "zarr.json", "c/0", "%2e%2e", "%2F", "a" * 300, "x/" * 50, "w/model", "float32", "bfloat16", "nan",
    "$float", "$bytes", "$tuple", "$$", "sha256:" + "0" * 64, "0", "-1", "1e400", "Infinity", " 0", "١",
]
BIG_INTS = [-1, 0, 1, 2, 3, 255, 2**31, 2**32, 2**53 + 1, 2**62, 2**63, 2**64, -(2**63), 10**30, -(10**30), 10**400]
hostile_text = st.one_of(
    st.sampled_from(HOSTILE_NAMES),
    st.text(max_size=12),
    st.text(st.characters(codec="utf-8", exclude_categories=()), max_size=6),
    st.text(st.characters(categories=["Cs", "Cc", "Cf", "Zs", "Mn"]), min_size=1, max_size=4),
)


def _json_strategies(finite: bool) -> tuple[st.SearchStrategy[Any], st.SearchStrategy[Any], st.SearchStrategy[Any]]:
    """(scalars, values, values with $-tags); ``finite``: no NaN/Infinity."""
    specials = [-0.0, 0.5, 2.0, 1e308, 5e-324] + ([] if finite else [math.nan, math.inf, -math.inf])
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-3, 40), st.sampled_from(BIG_INTS), st.integers(),
        st.sampled_from(specials), st.floats(allow_nan=not finite, allow_infinity=not finite), hostile_text,
    )
    def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(st.lists(children, max_size=3), st.dictionaries(hostile_text, children, max_size=3))

    values = st.recursive(scalars, containers, max_leaves=8)
    tagged = st.one_of(
        values,
        st.dictionaries(st.sampled_from(["$float", "$bytes", "$tuple", "$$x", "$", "$$float"]), values, min_size=1, max_size=2),
        st.builds(lambda t, v: {t: v}, st.sampled_from(["$float", "$bytes", "$tuple"]), scalars),
    )
    return scalars, values, tagged


json_scalars, json_values, tagged_values = _json_strategies(finite=False)
_, finite_json_values, finite_tagged_values = _json_strategies(finite=True)


def mutations(doc: str, *prefixes: tuple[Any, ...], ops: tuple[str, ...] = ("replace", "delete", "add"),
              values: st.SearchStrategy[Any] = json_values, exact: tuple[tuple[Any, ...], ...] = ()
              ) -> st.SearchStrategy[Mutation]:
    """Replace a node under ``prefixes`` (or one of the nodes ``exact``) of document ``doc``
    by a hostile JSON value, delete a member, or add a hostile member to a container."""

    @st.composite
    def strategy(draw: st.DrawFn) -> Mutation:
        op = draw(st.sampled_from(ops))
        kind = {"replace": "node", "delete": "member", "add": "container"}[op]
        paths = base().paths(doc, prefixes, kind, exact) or base().paths(doc, prefixes, "node", exact)
        path = draw(st.sampled_from(paths))
        if op == "replace":
            return ("replace", path, draw(values))
        if op == "delete":
            return ("delete", path, None) if path else ("replace", path, draw(values))
        return ("add", path, (draw(hostile_text), draw(values)))

    return strategy()


def write_json(path: Path, doc: Any) -> bytes:
    """Write ``doc`` as ucp_zarr formats documents (NaN/Infinity literals where present)."""
    raw = json.dumps(doc, indent=1).encode()
    path.write_bytes(raw)
    return raw


def digest(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def redigested(root: Any) -> Any:
    """``root`` (a commit record, edited in place) with its ``record_digest`` recomputed as an
    editor would, where it has one and stays canonical JSON: so that the checks behind the
    digest are reached (``test_integrity.py::test_a_changed_record_is_refused_by_its_digest``
    tests the digest itself)."""
    attrs = root.get("attributes") if isinstance(root, dict) else None
    attrs = attrs.get("ucp_zarr") if isinstance(attrs, dict) else None
    if isinstance(attrs, dict) and isinstance(attrs.get(RECORD_DIGEST), str):
        try:
            attrs[RECORD_DIGEST] = record_digest(attrs)
        except (ValueError, TypeError, RecursionError):
            pass
    return root


def mutate_root(ck: Path, m: Mutation, doc: str = "root") -> Any:
    """Write the mutated root (:func:`redigested`, unless the mutation is of the digest)."""
    mutated = apply(base().docs[doc], m)
    if not (RECORD_DIGEST in m[1] or (m[0] == "add" and m[2][0] == RECORD_DIGEST)):
        mutated = redigested(mutated)
    note(f"root document: {json.dumps(mutated)[:3000]}")
    write_json(ck / "zarr.json", mutated)
    return mutated


# === 0. the harness sees what it must ===========================================================


def _touch_memory(nbytes: int) -> None:
    np.ones(nbytes, dtype=np.uint8)


@pytest.mark.parametrize("misdeed", ["write-beside", "write-inside", "read-beside", "unpickle", "find-class", "exec", "hang",
                                     "memory", "foreign", "violation", "segfault"])
def test_harness_detects(misdeed: str) -> None:
    """Each check of :func:`problems_of` fires on the misdeed it is for (so that a passing
    property means something): writes, reads beside the checkpoint, unpickling (the
    replaced function, and a global resolved by any unpickler), exec of non-module code, a
    hang, a runaway allocation, an exception outside the hierarchy, a crash."""
    with sandbox(base().unsigned) as (box, ck):
        def work(results: list[dict[str, Any]]) -> None:
            def misbehave() -> None:
                if misdeed == "write-beside":
                    (box / "new").write_bytes(b"x")
                elif misdeed == "write-inside":
                    (ck / "new").write_bytes(b"x")
                elif misdeed == "read-beside":
                    (box / "secret").read_bytes()
                elif misdeed == "unpickle":
                    pickle.loads(pickle.dumps(1))
                elif misdeed == "find-class":
                    import _pickle

                    _pickle.loads(b"cbuiltins\nint\n.")  # the C unpickler, not the replaced function
                elif misdeed == "exec":
                    exec("1 + 1")
                elif misdeed == "hang":
                    time.sleep(60)
                elif misdeed == "memory":
                    _touch_memory(MEMORY_GROWTH_LIMIT + (64 << 20))
                elif misdeed == "foreign":
                    {}["internal"]
                elif misdeed == "violation":
                    _check_tensor("model.scale", torch.tensor(0.0))
                elif misdeed == "segfault":
                    import faulthandler

                    faulthandler.disable()  # (no report on the terminal: the parent reports the signal)
                    os.kill(os.getpid(), signal.SIGSEGV)

            attempt(results, "misdeed", misbehave)

        report = isolated(work, watch=box, timeout=0.5 if misdeed == "hang" else EXAMPLE_TIMEOUT_S)
        found = problems_of(report, box=box, ck=ck, may_write=misdeed == "write-inside")
        if misdeed == "write-inside":
            assert not found, found  # a writer may write inside its checkpoint
            assert any(k == "write" for k, _, _ in report.events)
        else:
            assert found, f"{misdeed} went unnoticed: {report}"
        assert problems_of(read_in_child(ck, box), box=box, ck=ck) == [], "the reader worker, on good data"


# === 1. the root commit record =================================================================


@dataclass(frozen=True)
class BytesEdit:
    """A byte-level edit of a document: truncate, insert, flip, replace, re-encode."""

    op: str
    at: int = 0
    data: bytes = b""
    needle: bytes = b""

    def apply(self, raw: bytes) -> bytes:
        at = self.at
        if self.needle:
            at = raw.index(self.needle) + self.at
        if self.op == "truncate":
            return raw[: at % max(len(raw), 1)]
        if self.op == "insert":
            at %= len(raw) + 1
            return raw[:at] + self.data + raw[at:]
        if self.op == "flip":
            at %= len(raw)
            return raw[:at] + bytes([raw[at] ^ (self.data[0] or 1)]) + raw[at + 1 :]
        if self.op == "replace":
            return self.data
        if self.op == "reencode":
            return raw.decode().encode(self.data.decode())
        raise AssertionError(self.op)


positions = st.integers(0, 1 << 20)
unparseable_edits = st.one_of(
    st.builds(BytesEdit, st.just("truncate"), positions),
    st.builds(BytesEdit, st.just("insert"), positions, st.sampled_from([b"\xff", b"\xc3", b"\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf"])),
    st.builds(BytesEdit, st.just("replace"), st.just(0), st.binary(max_size=64)),
    st.builds(BytesEdit, st.just("replace"), st.just(0), st.sampled_from(
        [b"", b" ", b"null", b"[]", b"0", b'"zarr"', b"NaN", b"-Infinity", b"{}", b'{"zarr_format": 3}', b"\xef\xbb\xbf{}",
         b'{"zarr_format": 3, "node_type": "group", "attributes": {"ucp_zarr": null}}',
         b'{"zarr_format": 3, "node_type": "group", "attributes": {"ucp_zarr": []}}',
         b'{"zarr_format": 3, "node_type": "group", "attributes": []}']
    )),
    st.builds(BytesEdit, st.just("reencode"), st.just(0), st.sampled_from([b"utf-16", b"utf-32", b"utf-16-be", b"utf-8-sig"])),
    st.builds(BytesEdit, st.just("insert"), st.just(0), st.sampled_from([b"\xef\xbb\xbf", b"\x00"])),
)


@_settings(45)
@given(edit=unparseable_edits)
def test_root_unparseable_bytes(edit: BytesEdit) -> None:
    """Truncated, invalid UTF-8, non-JSON or re-encoded bytes of the root document: a
    FormatError from every entry point where the bytes are not JSON as ``json.loads`` reads
    bytes (UTF-8/16/32 detected, a BOM skipped, surrogates passed through); everything works
    where they are the very document that was saved; else the saved bits or an error."""
    with sandbox(base().unsigned) as (box, ck):
        raw = edit.apply(base().raw["root"])
        (ck / "zarr.json").write_bytes(raw)
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = ValueError
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        if parsed == base().docs["root"]:
            assert all(r["outcome"] == "ok" for r in report.results if r["op"] != "wrong-key open"), report.results
        elif parsed is ValueError:
            expect(report, "open", "FormatError")
            expect(report, "load", "FormatError")


@_settings(60)
@example(edit=BytesEdit("flip", 11, b"\x04", needle=b'"$float":"nan"'))  # "nan" -> "nen"
@example(edit=BytesEdit("insert", 1, b"\xed\xa0\x80", needle=b'"layers.0.weight/zarr.json"'))  # a surrogate in a name
@given(edit=st.one_of(
    st.builds(BytesEdit, st.just("flip"), positions, st.binary(min_size=1, max_size=1)),
    # UTF-8 of a surrogate, which json.loads lets through (bytes are decoded with surrogatepass)
    st.builds(BytesEdit, st.just("insert"), positions, st.sampled_from([b"\xed\xa0\x80", b"\xed\xbf\xbf"]))))
def test_root_byte_edits(edit: BytesEdit) -> None:
    """One byte of the root document flipped anywhere, or an encoded surrogate inserted:
    success with the saved data (a change in a value or in whitespace is not protected by any
    digest in an unsigned checkpoint), or an error of the hierarchy."""
    with sandbox(base().unsigned) as (box, ck):
        raw = edit.apply(base().raw["root"])
        (ck / "zarr.json").write_bytes(raw)
        note(f"flipped: {raw[max(0, edit.at - 40): edit.at + 40]!r}")
        report = read_in_child(ck, box, values_intact=False, nonstrict=True)
        check(report, box=box, ck=ck)


@_settings(10)
@example(depth=100_000, opener="[")
@given(depth=st.integers(2_000, 300_000), opener=st.sampled_from(["[", '{"a":']))
def test_root_deep_nesting(depth: int, opener: str) -> None:
    with sandbox(base().unsigned) as (box, ck):
        closer = "]" if opener == "[" else "}"
        (ck / "zarr.json").write_text(opener * depth + "0" + closer * depth)
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        expect(report, "open", "FormatError")


@_settings(80)
@given(m=mutations("root", ROOT + ("tensors",)))
def test_root_tensor_index_mutations(m: Mutation) -> None:
    """The tensor index: wrong types at every level (lists for objects, strings for numbers,
    bools, NaN/Infinity, negative and huge shapes), missing and extra members, other
    paths/dtypes/digests/ranks. Reads succeed only with the saved bits."""
    with sandbox(base().unsigned) as (box, ck):
        mutated = mutate_root(ck, m)
        report = read_in_child(ck, box, nonstrict=True)
        check(report, box=box, ck=ck)
        if mutated == base().docs["root"]:
            assert all(r["outcome"] == "ok" for r in report.results if r["op"] != "wrong-key open"), report.results
        expect(report, "wrong-key open", "AuthenticationError", "FormatError")


ARRAY_PATHS_IN_INDEX = [("path",), ("ranks", "0", "path")]
hostile_array_paths = st.one_of(
    st.sampled_from(HOSTILE_NAMES),
    st.builds(lambda a, b: f"{a}/{b}", st.sampled_from(HOSTILE_NAMES + ["w", "layers.0.weight"]), st.sampled_from(HOSTILE_NAMES + ["model"])),
    st.sampled_from(["layers.0.weight/../../secret", "../canary", "..%2Fcanary", "canary/..", "/tmp/x", "a/b/c",
                     "layers.0.weight/model/c", "~/model", "layers.0.weight\\model", "layers.0.weight/model/",
                     "layers.0.weight//model", "layers.0.weight/model~2", "layers.0.weight/%6Dodel", "layers.0.weight/Model",
                     "rng/rng~rank1", "rng/rng", "scale/model/c/0"]),
    st.text(min_size=1, max_size=30),
)


def _array_paths() -> list[str]:
    return sorted({doc.removesuffix("/zarr.json") for doc in base().array_docs})


@_settings(50)
@given(key=st.sampled_from(sorted(ORIGINAL_TENSORS)), field=st.sampled_from(ARRAY_PATHS_IN_INDEX), path=hostile_array_paths)
def test_root_hostile_tensor_paths(key: str, field: tuple[str, ...], path: str) -> None:
    """Array paths with ``..``, ``/``, absolute paths, backslashes, ``~``, control
    characters, odd unicode, reserved names: refused (FormatError) before anything is read
    when they are not ``<group>/<array>`` of safe names; otherwise (a name with no document
    digest) refused when read. Never a read outside. (Another array's path:
    test_root_tensor_path_aliasing_another_array.)"""
    assume(path not in _array_paths())
    entry = base().docs["root"]["attributes"]["ucp_zarr"]["tensors"][key]
    if field[0] == "ranks" and "ranks" not in entry:
        field = ("path",)
    with sandbox(base().unsigned) as (box, ck):
        mutate_root(ck, ("replace", ROOT + ("tensors", key) + field, path))
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        if path == _get(entry, field):
            return
        if path.count("/") != 1 or not all(_COMPONENT.fullmatch(p) for p in path.split("/")):
            expect(report, "open", "FormatError")
            expect(report, "load", "FormatError")
        elif not refused_at_open(report):  # (a per-rank entry whose path is not rank 0's copy is)
            # a well-formed name: another array's (whose document names another key) or none
            op = f"read {key!r}" if field == ("path",) else f"read {key!r} rank 0"
            expect(report, op, "FormatError", exact=True)
            if key != "rng" or field != ("path",):  # (a load reads rank 0's copy of per-rank state)
                expect(report, "load", "FormatError", allow_ok=not _holds_data(key))


@_settings(60)
@example(key="model.scale", field=("path",), other="layers.0.weight/optim.step", first=True)
@given(key=st.sampled_from(sorted(ORIGINAL_TENSORS)), field=st.sampled_from(ARRAY_PATHS_IN_INDEX),
       other=st.sampled_from(["layers.0.weight/model", "layers.0.weight/optim.exp_avg", "layers.0.weight/optim.step",
                              "rng/rng~rank0", "scale/model", "ids/model", "empty/model"]), first=st.booleans())
def test_root_tensor_path_aliasing_another_array(key: str, field: tuple[str, ...], other: str, first: bool) -> None:
    """The index entry of ``key`` names the array of another tensor: refused at open (two
    entries name one array), so that no read of ``key`` can return the other tensor's data,
    whether or not the other tensor was read before (``first``)."""
    entry = base().docs["root"]["attributes"]["ucp_zarr"]["tensors"][key]
    if field[0] == "ranks" and "ranks" not in entry:
        field = ("path",)
    assume(_get(entry, field) != other)
    owner = next(k for d, (k, _) in base().array_docs.items() if d == f"{other}/zarr.json")
    with sandbox(base().unsigned) as (box, ck):
        mutate_root(ck, ("replace", ROOT + ("tensors", key) + field, other))

        def work(results: list[dict[str, Any]]) -> None:
            c = attempt(results, "open", lambda: ucp_zarr.open(ck))
            if c is not None:
                if first:
                    attempt(results, f"read {owner!r}", lambda: _check_tensor(owner, c[owner][...]))
                op = f"read {key!r}" if field == ("path",) else f"read {key!r} rank 0"
                attempt(results, op, lambda: _check_tensor(key, c.read(key, rank=None if field == ("path",) else 0)))
            attempt(results, "load", lambda: _check_loaded(ucp_zarr.load(make_state(True), ck), True))

        report = isolated(work, watch=box)
        check(report, box=box, ck=ck)
        expect(report, "open", "FormatError")
        expect(report, "load", "FormatError")


@_settings(60)
@example(key="model.layers.0.weight", path="a" * 300 + "/model", digest_of=None)
@given(key=st.sampled_from(sorted(ORIGINAL_TENSORS)), path=st.one_of(
    hostile_array_paths, st.builds(lambda n, m: "g" * n + "/" + m, st.integers(200, 5000), st.sampled_from(["model", "x" * 300]))),
    digest_of=st.one_of(st.none(), st.sampled_from(["layers.0.weight/model/zarr.json", "rng/rng~rank0/zarr.json"])))
def test_root_hostile_tensor_paths_with_documents(key: str, path: str, digest_of: str | None) -> None:
    """As above, and the commit record also lists a digest for ``<path>/zarr.json`` (the
    digest of an existing document, or a wrong one), so that the document is looked up."""
    with sandbox(base().unsigned) as (box, ck):
        doc = base().docs["root"]
        m1 = ("replace", ROOT + ("tensors", key, "path"), path)
        value = digest(base().raw[digest_of]) if digest_of else "sha256:" + "0" * 64
        mutated = apply(apply(doc, m1), ("add", ROOT + ("documents",), (f"{path}/zarr.json", value)))
        write_json(ck / "zarr.json", redigested(mutated))
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        if path != doc["attributes"]["ucp_zarr"]["tensors"][key]["path"] and not refused_at_open(report):
            expect(report, f"read {key!r}", "FormatError", "CorruptChunkError")


@_settings(30)
@given(key=st.sampled_from(sorted(ORIGINAL_TENSORS)), dtype=st.one_of(
    st.sampled_from(["float32", "float64", "bfloat16", "int32", "uint8", "bool", "float8_e4m3fn", "complex64", "int4",
                     "float4_e2m1fn_x2", "qint8", "object", "torch.float32", "Float32", "float32 ", "", "<f4", "O"]),
    hostile_text))
def test_root_dtypes(key: str, dtype: str) -> None:
    """The index names another dtype: unknown ones are refused at open, known ones when the
    array document (which says otherwise) is read."""
    entry = base().docs["root"]["attributes"]["ucp_zarr"]["tensors"][key]
    with sandbox(base().unsigned) as (box, ck):
        mutate_root(ck, ("replace", ROOT + ("tensors", key, "dtype"), dtype))
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        if dtype != entry["dtype"]:
            from ucp_zarr.format.dtypes import supported_dtypes

            known = dtype in {str(d).removeprefix("torch.") for d in supported_dtypes()}
            if not known:
                expect(report, "open", "FormatError")
            else:
                expect(report, f"read {key!r}", "FormatError")
                expect(report, "verify", "FormatError")
                expect(report, "load", "FormatError", "DtypeMismatchError", allow_ok=not _holds_data(key))


@_settings(20)
@given(version=json_values)
@example(version=1)
@example(version=3)
@example(version="2")
@example(version=True)
@example(version=2.0)
def test_root_format_version(version: Any) -> None:
    """Any format_version but 2 is refused at open with a FormatError naming it (2.0 is the
    same JSON number)."""
    with sandbox(base().unsigned) as (box, ck):
        mutate_root(ck, ("replace", ROOT + ("format_version",), version))
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        if not (version == 2 and not isinstance(version, bool)):
            expect(report, "open", "FormatError")
            expect(report, "load", "FormatError")
            want = "is not valid JSON" if _holds_nonfinite(version) else "format_version"  # (NaN is not JSON)
            assert want in report.outcome("open")["detail"]


def _holds_nonfinite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_holds_nonfinite(v) for v in value.values())
    return isinstance(value, list) and any(_holds_nonfinite(v) for v in value)


@_settings(30)
@given(save_id=st.one_of(
    json_values, st.text("0123456789abcdef", min_size=31, max_size=33), st.text("0123456789ABCDEFabcdefg", min_size=32, max_size=32),
    st.binary(min_size=16, max_size=16).map(bytes.hex)))
def test_root_save_id(save_id: Any) -> None:
    """A malformed save id is refused at open; another well-formed one opens, but no shard of
    this checkpoint is accepted under it (CorruptChunkError from every read and verify)."""
    with sandbox(base().unsigned) as (box, ck):
        mutate_root(ck, ("replace", ROOT + ("save_id",), save_id))
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        original = base().docs["root"]["attributes"]["ucp_zarr"]["save_id"]
        if save_id == original:
            return
        if isinstance(save_id, str) and re.fullmatch(r"[0-9a-f]{32}", save_id):
            for r in report.ops("read "):
                if r["op"] not in ("read 'model.empty'", "read part of 'model.empty'"):
                    assert r["outcome"] == "error" and r["type"] == "CorruptChunkError", r
            expect(report, "verify", "CorruptChunkError")
            expect(report, "load", "CorruptChunkError")
        else:
            expect(report, "open", "FormatError")


OTHER_FIELDS = (("zarr_format",), ("node_type",), ROOT + ("created",), ROOT + ("library",), ROOT + ("layout",))
FRAME = ((), ("attributes",), ROOT)
"""The document, its attributes and the ucp_zarr member as wholes (not what they hold)."""


@_settings(35)
@given(m=mutations("root", *OTHER_FIELDS, exact=FRAME))
def test_root_structure_and_other_fields(m: Mutation) -> None:
    """The document's frame (zarr_format, node_type, attributes, the ucp_zarr member as a
    whole) and the informational members (created, library, layout): wrong types, missing and
    extra members. A missing/mistyped frame or member is refused at open; informational
    members may change freely (they are not used to read data)."""
    with sandbox(base().unsigned) as (box, ck):
        mutated = mutate_root(ck, m)
        report = read_in_child(ck, box, nonstrict=True)
        check(report, box=box, ck=ck)
        if mutated == base().docs["root"]:
            assert all(r["outcome"] == "ok" for r in report.results if r["op"] != "wrong-key open")
        expect(report, "wrong-key open", "AuthenticationError", "FormatError")


@_settings(60)
@example(m=("replace", ROOT + ("world_size",), math.inf))
@given(m=mutations("root", ROOT + ("world_size",), ops=("replace", "delete"),
                   values=st.one_of(json_values, st.sampled_from([0, -1, 2**62, 10**400, 2**26]))))
def test_root_world_size(m: Mutation) -> None:
    with sandbox(base().unsigned) as (box, ck):
        mutate_root(ck, m)
        report = read_in_child(ck, box, nonstrict=True)
        check(report, box=box, ck=ck)


@_settings(30)
@example(world_size=0)
@given(world_size=st.one_of(st.integers(-3, 0), st.sampled_from([2**26, 2**40, 2**62])))
def test_root_world_size_with_unrestorable_per_rank_state(world_size: int) -> None:
    """Per-rank state saved only by rank 1 (so rank 0 cannot restore it) and a world size of
    ``world_size``: strict load must raise PerRankStateError, quickly."""
    with sandbox(base().unsigned) as (box, ck):
        doc = apply(base().docs["root"], ("replace", ROOT + ("world_size",), world_size))
        doc["attributes"]["ucp_zarr"]["rank_values"]["loader"] = {"1": {"epoch": 1, "pos": 17}}
        write_json(ck / "zarr.json", redigested(doc))
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        expect(report, "load", "PerRankStateError", "FormatError")


@_settings(100)
@example(m=("replace", ROOT + ("values", "extra.nan"), {"$float": "nope"}))
@given(m=mutations("root", ROOT + ("values",), ROOT + ("rank_values",), values=tagged_values))
def test_root_values(m: Mutation) -> None:
    """Non-tensor values and per-rank values (JSON, with ``$float``/``$bytes``/``$tuple``
    tags): any change that is not a valid encoding is an error of the hierarchy; tensors are
    unaffected."""
    with sandbox(base().unsigned) as (box, ck):
        mutate_root(ck, m)
        report = read_in_child(ck, box, values_intact=False, nonstrict=True)
        check(report, box=box, ck=ck)
        for r in report.ops("read "):
            assert r["outcome"] == "ok", r


@st.composite
def document_entry_edits(draw: st.DrawFn) -> Mutation:
    """Missing or wrong digests of existing documents (or the member replaced whole by a
    non-object): not new document names, which test_root_documents_hostile_entries covers."""
    docs = sorted(base().docs["root"]["attributes"]["ucp_zarr"]["documents"])
    where = ROOT + ("documents",)
    kind = draw(st.sampled_from(["delete", "wrong", "other", "garbage", "whole"]))
    if kind == "whole":
        return ("replace", where, draw(st.one_of(st.just({}), json_scalars, st.lists(json_scalars, max_size=3))))
    name = draw(st.sampled_from(docs))
    if kind == "delete":
        return ("delete", where + (name,), None)
    if kind == "wrong":
        value = "sha256:" + draw(st.text("0123456789abcdef", min_size=64, max_size=64))
    elif kind == "other":
        value = base().docs["root"]["attributes"]["ucp_zarr"]["documents"][draw(st.sampled_from(docs))]
    else:
        value = draw(json_values)
    return ("replace", where + (name,), value)


@_settings(45)
@given(m=document_entry_edits())
def test_root_documents_missing_or_wrong(m: Mutation) -> None:
    """A document whose digest is missing or wrong is refused where it is read: array
    documents by every read of their tensor, group documents by verify."""
    with sandbox(base().unsigned) as (box, ck):
        mutated = mutate_root(ck, m)
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        before = base().docs["root"]["attributes"]["ucp_zarr"]["documents"]
        after = mutated["attributes"]["ucp_zarr"].get("documents")
        if not isinstance(after, dict):
            # refused at open -- or read as dict(value) (a list of pairs), and then no array
            # document has its digest any more: every read of data is refused
            if report.outcome("open")["outcome"] == "ok":
                after = {}
            else:
                expect(report, "open", "FormatError")
                return
        if refused_at_open(report):  # a member that is no document path, or no digest
            return
        # a group document (which holds nothing a read uses) whose digest is missing is not
        # checked any more; one whose digest is wrong is refused by verify; an array document
        # with a missing or wrong digest is refused by every read of its tensor
        changed = [d for d in before if str(after.get(d)) != before[d]]
        for d in changed:
            if d in after or d in base().array_docs:
                expect(report, "verify", "FormatError", "CorruptChunkError")
            if d in base().array_docs:
                key, rank = base().array_docs[d]
                op = f"read {key!r} rank {rank}" if rank is not None else f"read {key!r}"
                expect(report, op, "FormatError", "CorruptChunkError")
                expect(report, "load", "FormatError", "CorruptChunkError", allow_ok=not _holds_data(key))


DOCUMENT_NAMES = [
    "layers.0.weight/model", "layers.0.weight/", "layers.0.weight/model/c", "/zarr.json", "../secret", "../zarr.json",
    "../canary", "a/\x00", "a/\ud800", "layers.0.weight/" + "x" * 300, "layers.0.weight/\n", "a/b", "zarr.json", ".", "/",
    "layers.0.weight/..", "rng/rng~rank0/c", "./zarr.json",
]


@_settings(60)
@example(name="layers.0.weight/model", value=None)
@given(name=st.one_of(st.sampled_from(DOCUMENT_NAMES), hostile_text), value=st.one_of(st.none(), json_values))
def test_root_documents_hostile_entries(name: str, value: Any) -> None:
    """Extra members of ``documents`` with hostile names, their digest being that of the file
    the name reaches beside the checkpoint where there is one (``value`` None) or anything."""
    with sandbox(base().unsigned) as (box, ck):
        if value is None:
            with contextlib.suppress(OSError, ValueError):
                value = digest((ck / name).read_bytes())
        mutate_root(ck, ("add", ROOT + ("documents",), (name, value)))
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)


SIGNED_PARTS = (ROOT + ("tensors",), ROOT + ("values",), ROOT + ("rank_values",), ROOT + ("documents",), ROOT + ("signature",),
                ROOT + ("save_id",), ROOT + ("layout",))


@_settings(50)
@given(m=mutations("signed_root", *SIGNED_PARTS, values=finite_tagged_values))
def test_signed_root_mutations_are_refused_with_the_key(m: Mutation) -> None:
    """A signed checkpoint read with its key: any change to the index, values, digests, save
    id or signature is refused (AuthenticationError) -- success only for a document whose
    signed content is unchanged. (Finite numbers; NaN/Infinity: the next test.)"""
    _signed_root_mutation(m)


@_settings(30)
@example(m=("replace", ROOT + ("values", "step"), math.nan))
@given(m=mutations("signed_root", *SIGNED_PARTS, values=st.sampled_from([math.nan, math.inf, -math.inf, [math.nan], {"$float": math.inf}])))
def test_signed_root_non_finite_numbers(m: Mutation) -> None:
    _signed_root_mutation(m)


def _signed_root_mutation(m: Mutation) -> None:
    __tracebackhide__ = True  # (pytest reports the caller's line)
    from ucp_zarr.format.integrity import canonical

    with sandbox(base().signed) as (box, ck):
        mutated = mutate_root(ck, m, doc="signed_root")
        report = read_in_child(ck, box, key=HMAC_KEY, values_intact=False)
        check(report, box=box, ck=ck)
        want = base().docs["signed_root"]["attributes"]["ucp_zarr"]
        try:
            attrs = mutated["attributes"]["ucp_zarr"]
            sig = attrs["signature"]
            # what the signature covers (everything but itself), and the signature's own members
            same = canonical({k: v for k, v in attrs.items() if k != "signature"}) == canonical(
                {k: v for k, v in want.items() if k != "signature"}
            ) and (sig["alg"], sig["value"]) == (want["signature"]["alg"], want["signature"]["value"])
        except (TypeError, ValueError, KeyError, AttributeError):
            same = False
        if not same:
            expect(report, "open", "AuthenticationError", "FormatError")
            expect(report, "load", "AuthenticationError", "FormatError")


# === 2. array documents ========================================================================


def array_doc_mutations(bool_arrays: bool) -> st.SearchStrategy[tuple[str, Mutation]]:
    """A mutation of an array document: of a bool array's (``bool_arrays``), or any other's."""

    @st.composite
    def strategy(draw: st.DrawFn) -> tuple[str, Mutation]:
        docs = sorted(d for d in base().array_docs if (base().docs[d]["data_type"] == "bool") == bool_arrays)
        doc = draw(st.sampled_from(docs))
        return doc, draw(mutations(doc, ()))

    return strategy()


def rewrite_array_doc(ck: Path, doc: str, new: Any | bytes, redigest: bool) -> bool:
    """Write array document ``doc``; with ``redigest`` also put its new digest in the commit
    record. True when its bytes changed."""
    raw = new if isinstance(new, bytes) else json.dumps(new, indent=1).encode()
    (ck / doc).write_bytes(raw)
    if redigest:
        root = copy.deepcopy(base().docs["root"])
        root["attributes"]["ucp_zarr"]["documents"][doc] = digest(raw)
        write_json(ck / "zarr.json", redigested(root))
    return raw != base().raw[doc]


def _readers_of(doc: str) -> list[str]:
    key, rank = base().array_docs[doc]
    ops = [f"read {key!r}"] + ([f"read part of {key!r}"] if key in PART_READS else [])
    if rank is not None:
        ops.append(f"read {key!r} rank {rank}")
    return ops


array_byte_edits = st.one_of(
    st.builds(BytesEdit, st.just("flip"), positions, st.binary(min_size=1, max_size=1)),
    st.builds(BytesEdit, st.just("truncate"), positions),
    st.builds(BytesEdit, st.just("insert"), positions, st.sampled_from([b" ", b"\n", b"\xff", b"{}", b"\x00"])),
    st.builds(BytesEdit, st.just("reencode"), st.just(0), st.sampled_from([b"utf-16", b"utf-8"])),
)


@_settings(40)
@given(data=st.data())
def test_array_document_changed_is_refused(data: st.DataObject) -> None:
    """Any change to the bytes of a stored array document (a JSON change, a flipped byte,
    even whitespace) is found by verify, because the commit record holds its SHA-256. Reads
    use the root's consolidated copy (checked against that digest), so they stay right; in
    a root without consolidated metadata (older checkpoints) every read of the tensor
    refuses with CorruptChunkError. The other tensors read fine."""
    doc = data.draw(st.sampled_from(sorted(base().array_docs)), label="document")
    change = data.draw(st.one_of(mutations(doc, ()), array_byte_edits))
    consolidated = data.draw(st.booleans(), label="consolidated")
    with sandbox(base().unsigned) as (box, ck):
        if isinstance(change, BytesEdit):
            new: Any = change.apply(base().raw[doc])
        else:
            new = apply(base().docs[doc], change)
        changed = rewrite_array_doc(ck, doc, new, redigest=False)
        if not consolidated:
            root = copy.deepcopy(base().docs["root"])
            del root["consolidated_metadata"]
            write_json(ck / "zarr.json", redigested(root))
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        expect_ok(report, "open")
        if changed:
            for op in _readers_of(doc):
                if consolidated:
                    expect_ok(report, op)
                else:
                    expect(report, op, "CorruptChunkError")
            expect(report, "verify", "CorruptChunkError")
            if consolidated:
                expect_ok(report, "load")
            else:
                expect(report, "load", "CorruptChunkError", allow_ok=not _holds_data(base().array_docs[doc][0]))
        for r in report.ops("read "):
            if r["op"] not in _readers_of(doc):
                assert r["outcome"] == "ok", r


@_settings(65)
@given(change=array_doc_mutations(bool_arrays=False))
def test_array_document_mutations_redigested(change: tuple[str, Mutation]) -> None:
    """Array documents changed anywhere (wrong types, missing and extra members) with their
    digest rewritten in the commit record, so that the document's own validation runs:
    success only with the saved bits (extra attributes or other regions are harmless), else
    an error of the hierarchy. (Bool arrays: the next test.)"""
    _array_document_mutation_redigested(change)


@_settings(40)
@example(change=("mask/model/zarr.json", ("replace", ("fill_value",), [])))
@given(change=array_doc_mutations(bool_arrays=True))
def test_bool_array_document_mutations_redigested(change: tuple[str, Mutation]) -> None:
    _array_document_mutation_redigested(change)


def _array_document_mutation_redigested(change: tuple[str, Mutation]) -> None:
    __tracebackhide__ = True  # (pytest reports the caller's line)
    doc, m = change
    with sandbox(base().unsigned) as (box, ck):
        rewrite_array_doc(ck, doc, apply(base().docs[doc], m), redigest=True)
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        expect_ok(report, "open")


def _shapes(max_rank: int = 3) -> st.SearchStrategy[list[int]]:
    dims = st.one_of(st.integers(-2, 20), st.sampled_from([0, 7, 16, 2**31, 2**32, 2**40, 2**62, 2**63, 2**64]))
    return st.lists(dims, min_size=0, max_size=max_rank)


CODECS = [
    {"name": "zstd", "configuration": {"level": 1, "checksum": False}},
    {"name": "gzip", "configuration": {"level": 1}},
    {"name": "transpose", "configuration": {"order": [1, 0]}},
    {"name": "transpose", "configuration": {"order": [0]}},
    {"name": "crc32c"},
    {"name": "bytes", "configuration": {"endian": "big"}},
    {"name": "blosc", "configuration": {"cname": "lz4", "clevel": 1, "shuffle": "noshuffle", "typesize": 4, "blocksize": 0}},
    {"name": "no-such-codec"},
]


@dataclass(frozen=True)
class Structural:
    """A change the Zarr model of an array document sees: byte order, index location, extra
    codecs, data type, shapes, chunk grids, chunk key encoding, node type, version."""

    name: str
    arg: Any = None

    def equivalent(self, doc: dict[str, Any]) -> bool:
        """Whether the change may leave the document meaning what it meant (so accepting it is
        harmless): another spelling of the same thing in Zarr v3, or a member that does not
        bear on reading (a fill value is never used: every chunk is stored)."""
        if self.name in ("dimension_names", "storage_transformers", "fill_value"):
            return True
        if self.name == "endian":  # one-byte data types have no byte order
            return doc["data_type"] in ("uint8", "int8", "bool")
        if self.name == "chunk_key_encoding":  # the default separator is "/"
            return self.arg in ({"name": "default"}, "default")
        return False

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        d = copy.deepcopy(doc)
        sharding = d["codecs"][0]["configuration"]
        attrs = d["attributes"]["ucp_zarr"]
        n, a = self.name, self.arg
        if n == "endian":
            sharding[a][0]["configuration"]["endian"] = "big"
        elif n == "index_location":
            sharding["index_location"] = a
        elif n == "extra_codec":
            where, at, codec = a
            chain = d["codecs"] if where == "outer" else sharding[where]
            chain.insert(at % (len(chain) + 1), codec)
        elif n == "no_sharding":
            d["codecs"] = sharding["codecs"]
        elif n in ("data_type", "fill_value", "zarr_format", "node_type", "shape", "dimension_names", "storage_transformers"):
            d[n] = a
        elif n in ("torch_dtype", "global_shape", "key", "format_version"):
            attrs[n] = a
        elif n == "both_shapes":
            d["shape"] = attrs["global_shape"] = a
        elif n == "shard_shape":
            d["chunk_grid"]["configuration"]["chunk_shape"] = a
        elif n == "chunk_shape":
            sharding["chunk_shape"] = a
        elif n == "grid":
            d["chunk_grid"]["configuration"]["chunk_shape"], sharding["chunk_shape"] = a
        elif n == "chunk_key_encoding":
            d["chunk_key_encoding"] = a
        else:
            raise AssertionError(n)
        return d


STRUCTURAL = st.one_of(
    st.builds(Structural, st.just("endian"), st.sampled_from(["codecs", "index_codecs"])),
    st.builds(Structural, st.just("index_location"), st.sampled_from(["start", "middle", "", None, 0])),
    st.builds(Structural, st.just("extra_codec"), st.tuples(
        st.sampled_from(["outer", "codecs", "index_codecs"]), st.integers(0, 3), st.sampled_from(CODECS))),
    st.builds(Structural, st.just("no_sharding")),
    st.builds(Structural, st.just("data_type"), st.one_of(st.sampled_from(
        ["float32", "float64", "float16", "uint16", "uint8", "int32", "int64", "bool", "complex64", "bfloat16", "string",
         "bytes", "r16", "<f4", ">f4", "float8_e4m3fn", "uint32"]), json_scalars)),
    st.builds(Structural, st.just("torch_dtype"), st.one_of(st.sampled_from(
        ["float32", "bfloat16", "int32", "uint8", "bool", "float16", "float8_e5m2", "uint16"]), json_scalars)),
    st.builds(Structural, st.sampled_from(["shape", "global_shape", "both_shapes", "shard_shape", "chunk_shape"]), _shapes()),
    st.builds(Structural, st.just("grid"), st.tuples(_shapes(), _shapes())),
    st.builds(Structural, st.just("grid"), st.sampled_from([
        ([2**62, 2**62], [2**62, 2**62]), ([2**40, 2**40], [1, 1]), ([16, 12], [0, 12]), ([16, 12], [-4, 12]),
        ([16, 12], [5, 12]), ([16, 12], [16, 12]), ([2**31, 12], [2**31, 12]), ([16384, 16384], [16384, 16384]),
        ([1 << 22, 1], [1, 1]), ([1 << 23, 1], [1, 1]), ([2**20, 2**20], [2**10, 2**10]),
    ])),
    st.builds(Structural, st.just("key"), hostile_text),
    st.builds(Structural, st.just("fill_value"), json_scalars),
    st.builds(Structural, st.sampled_from(["zarr_format", "node_type", "format_version"]), json_scalars),
    st.builds(Structural, st.just("chunk_key_encoding"), st.sampled_from([
        {"name": "default", "configuration": {"separator": "."}}, {"name": "v2"}, {"name": "default"},
        {"name": "v2", "configuration": {"separator": "/"}}, {"name": "nope"}, None, "default"])),
    st.builds(Structural, st.just("dimension_names"), st.sampled_from([["a", "b"], ["a"], None, [None, None], "ab", [1, 2]])),
    st.builds(Structural, st.just("storage_transformers"), st.sampled_from([[], [{"name": "x"}], None])),
)


@_settings(55)
@given(doc=st.sampled_from(["layers.0.weight/model/zarr.json", "layers.0.bias/model/zarr.json", "scale/model/zarr.json",
                            "rng/rng~rank0/zarr.json", "mask/model/zarr.json", "ids/model/zarr.json"]),
       change=STRUCTURAL)
@example(doc="layers.0.weight/model/zarr.json", change=Structural("endian", "codecs"))
@example(doc="layers.0.weight/model/zarr.json", change=Structural("index_location", "start"))
@example(doc="layers.0.weight/model/zarr.json", change=Structural("extra_codec", ("codecs", 2, CODECS[0])))
@example(doc="layers.0.weight/model/zarr.json", change=Structural("extra_codec", ("codecs", 0, CODECS[2])))
@example(doc="layers.0.bias/model/zarr.json", change=Structural("data_type", "float16"))
@example(doc="layers.0.weight/model/zarr.json", change=Structural("grid", ([2**62, 2**62], [2**62, 2**62])))
@example(doc="layers.0.weight/model/zarr.json", change=Structural("grid", ([16, 12], [5, 12])))
@example(doc="layers.0.weight/model/zarr.json", change=Structural("grid", ([16384, 16384], [16384, 16384])))
@example(doc="layers.0.weight/model/zarr.json", change=Structural("both_shapes", [2**62, 12]))
@example(doc="layers.0.weight/model/zarr.json", change=Structural("grid", ([4194304, 1], [1, 1])))
def test_array_document_structural_changes_redigested(doc: str, change: Structural) -> None:
    """What zarr's model of an array document sees (big-endian bytes codec, index at the
    start, extra zstd/gzip/transpose codecs, another data_type for the torch_dtype, shapes
    other than the index's, chunk shapes that do not divide the shard, zero/negative/gigantic
    chunk and shard shapes, other key encodings), digest rewritten: every read of the tensor
    refuses it with an error of the hierarchy, without allocating what the shapes say."""
    with sandbox(base().unsigned) as (box, ck):
        try:
            new = change.apply(base().docs[doc])
        except (IndexError, KeyError, TypeError):
            return  # not applicable to this document (a 1-d array has no second dim...)
        rewrite_array_doc(ck, doc, new, redigest=True)
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        expect_ok(report, "open")
        # (a fill value is never used -- every chunk is stored -- and zarr compares it after
        # conversion to the data type, so another spelling of zero may pass: not required)
        if new != base().docs[doc] and not change.equivalent(base().docs[doc]):
            for op in _readers_of(doc):
                expect(report, op, "FormatError", "CorruptChunkError")
            expect(report, "verify", "FormatError", "CorruptChunkError")
            expect(report, "load", "FormatError", "CorruptChunkError")


@_settings(25)
@given(regions=json_values, rank=st.one_of(st.just("keep"), json_values),
       doc=st.sampled_from(["layers.0.weight/model/zarr.json", "rng/rng~rank0/zarr.json", "scale/model/zarr.json"]))
def test_array_document_regions_and_rank_redigested(regions: Any, rank: Any, doc: str) -> None:
    """Garbage regions and ranks (digest rewritten): an error of the hierarchy, or -- regions
    and writers are informational -- the saved bits."""
    with sandbox(base().unsigned) as (box, ck):
        new = copy.deepcopy(base().docs[doc])
        new["attributes"]["ucp_zarr"]["regions"] = regions
        if rank != "keep":
            new["attributes"]["ucp_zarr"]["rank"] = rank
        rewrite_array_doc(ck, doc, new, redigest=True)
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)


@_settings(30)
@example(doc="ids/model/zarr.json", shape=[2**62])
@given(doc=st.sampled_from(["layers.0.weight/model/zarr.json", "ids/model/zarr.json", "scale/model/zarr.json"]),
       shape=st.lists(st.sampled_from([1, 3, 2**20, 2**31, 2**40, 2**62]), min_size=1, max_size=2))
def test_forged_shape_in_root_and_array_document(doc: str, shape: list[int]) -> None:
    """A consistent forgery: the index and the array document (digest rewritten) both claim a
    gigantic shape. Reads must fail with an error of the hierarchy (the shards do not match),
    without allocating the claimed size; load refuses the shape."""
    key, _ = base().array_docs[doc]
    with sandbox(base().unsigned) as (box, ck):
        new = copy.deepcopy(base().docs[doc])
        new["shape"] = new["attributes"]["ucp_zarr"]["global_shape"] = shape
        new["chunk_grid"]["configuration"]["chunk_shape"] = [min(n, 1 << 10) for n in shape]
        new["codecs"][0]["configuration"]["chunk_shape"] = [min(n, 1 << 10) for n in shape]
        new["attributes"]["ucp_zarr"]["regions"] = [{"offset": [0] * len(shape), "shape": shape, "replicas": [0], "writers": [0]}]
        raw = json.dumps(new, indent=1).encode()
        (ck / doc).write_bytes(raw)
        root = copy.deepcopy(base().docs["root"])
        root["attributes"]["ucp_zarr"]["documents"][doc] = digest(raw)
        root["attributes"]["ucp_zarr"]["tensors"][key]["shape"] = shape
        write_json(ck / "zarr.json", root)
        report = isolated(lambda results: _forged_reads(ck, key, results), watch=box)
        check(report, box=box, ck=ck)
        for r in report.results:
            if r["op"] != "open":
                assert r["outcome"] == "error", r


def _forged_reads(ck: Path, key: str, results: list[dict[str, Any]]) -> None:
    c = attempt(results, "open", lambda: ucp_zarr.open(ck))
    if c is None:
        return
    attempt(results, "read whole", lambda: c[key][...])
    attempt(results, "read first", lambda: c[key][(0,) * c[key].ndim])
    attempt(results, "verify", c.verify)
    attempt(results, "load", lambda: ucp_zarr.load(make_state(True), ck))


# === 3. shard objects ==========================================================================


@dataclass(frozen=True)
class ShardDamage:
    op: str
    shard: int = 0
    at: int = 0
    data: bytes = b""
    other: int = 0


SHARD_DAMAGE = st.one_of(
    st.builds(ShardDamage, st.just("truncate"), st.integers(0, 999), positions),
    st.builds(ShardDamage, st.sampled_from(["flip", "flip-index", "flip-trailer", "flip-chunks"]), st.integers(0, 999),
              positions, st.binary(min_size=1, max_size=1)),
    st.builds(ShardDamage, st.just("append"), st.integers(0, 999), st.just(0), st.binary(min_size=1, max_size=40)),
    st.builds(ShardDamage, st.sampled_from(["swap", "copy-other"]), st.integers(0, 999), st.just(0), st.just(b""), st.integers(0, 999)),
    st.builds(ShardDamage, st.sampled_from(["twin", "delete", "empty", "directory", "zeros", "dev-null"]), st.integers(0, 999)),
)


def _shard_regions(doc: dict[str, Any], size: int) -> dict[str, tuple[int, int]]:
    """Byte ranges of a shard object: chunks, trailer, index (see ucp_zarr.format.codec)."""
    from ucp_zarr.format.codec import trailer_nbytes

    shard = doc["chunk_grid"]["configuration"]["chunk_shape"]
    chunk = doc["codecs"][0]["configuration"]["chunk_shape"]
    n = math.prod(s // c for s, c in zip(shard, chunk))
    index = 16 * n + 4
    trailer = trailer_nbytes(n, False)
    return {"flip-index": (size - index, size), "flip-trailer": (size - index - trailer, size - index),
            "flip-chunks": (0, size - index - trailer), "flip": (0, size)}


@_settings(70)
@given(damage=SHARD_DAMAGE)
@example(damage=ShardDamage("twin", 0))
@example(damage=ShardDamage("swap", 0, other=1))
def test_shard_damage_is_detected(damage: ShardDamage) -> None:
    """Truncated shards, flipped bytes in chunks/trailer/index, appended bytes, shards swapped
    between arrays or positions, a shard from another save of the same data, deleted/empty/
    zeroed shards, a directory in place of a shard: CorruptChunkError from every read of the
    tensor, from load and from verify. Other tensors read fine."""
    shards = base().shards
    rel, doc, key = shards[damage.shard % len(shards)]
    with sandbox(base().unsigned) as (box, ck):
        target = ck / rel
        raw = target.read_bytes()
        if damage.op == "truncate":
            target.write_bytes(raw[: damage.at % len(raw)])
        elif damage.op.startswith("flip"):
            lo, hi = _shard_regions(base().docs[doc], len(raw))[damage.op]
            assume(hi > lo)
            at = lo + damage.at % (hi - lo)
            target.write_bytes(raw[:at] + bytes([raw[at] ^ (damage.data[0] or 0x80)]) + raw[at + 1 :])
        elif damage.op == "append":
            target.write_bytes(raw + damage.data)
        elif damage.op in ("swap", "copy-other"):
            other = shards[damage.other % len(shards)][0]
            if other == rel:
                other = shards[(damage.other + 1) % len(shards)][0]
            o = ck / other
            if damage.op == "swap":
                praw = o.read_bytes()
                o.write_bytes(raw)
            else:
                praw = (ck / other).read_bytes()
            target.write_bytes(praw)
        elif damage.op == "twin":
            twin = base().twin / rel
            assert twin.read_bytes() != raw
            target.write_bytes(twin.read_bytes())
        elif damage.op == "delete":
            target.unlink()
        elif damage.op == "empty":
            target.write_bytes(b"")
        elif damage.op == "zeros":
            target.write_bytes(bytes(len(raw)))
        elif damage.op == "directory":
            target.unlink()
            target.mkdir()
        elif damage.op == "dev-null":
            target.unlink()
            target.symlink_to("/dev/null")
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        expect_ok(report, "open")
        affected = {key}
        if damage.op == "swap":
            affected.add(next(k for r, _, k in shards if r == other))
        for k in affected:  # whole reads; a partial read may miss the damage (then: the saved bits)
            expect(report, f"read {k!r}", "CorruptChunkError")
        expect(report, "verify", "CorruptChunkError")
        expect(report, "load", "CorruptChunkError")
        for r in report.ops("read "):
            if not any(f"{k!r}" in r["op"] for k in affected):
                assert r["outcome"] == "ok", r


# === 4. the save API ===========================================================================


def save_in_child(box: Path, ck: Path, build: Callable[[], dict[str, Any]], *, overwrite: bool = False,
                  roundtrip: bool = True, template: Callable[[], dict[str, Any]] | None = None) -> Report:
    """Save ``build()`` at ``ck`` in a child; where the save succeeded, read it back (open,
    every key, load into ``template()``) and compare. Checks that nothing outside ``ck``
    changed (every entry of the sandbox, with its type, size and mtime, before and after) and
    that every name written is escaped."""
    __tracebackhide__ = True  # (pytest reports the caller's line)
    before = _entries(box)

    def work(results: list[dict[str, Any]]) -> None:
        sd = build()
        done = attempt(results, "save", lambda: ucp_zarr.save(sd, ck, overwrite=overwrite, chunk_bytes=256, lease_s=30))
        if done is None or not roundtrip:
            return
        want = {leaf.key: _unwrap(leaf.value) for leaf in iter_leaves(sd)}

        def reopen() -> None:
            c = ucp_zarr.open(ck)
            tensors = {k for k, v in want.items() if isinstance(v, torch.Tensor)}
            stored = set(c.keys()) | set(c.ties)  # (one tensor under two keys is stored once, tied)
            if stored != tensors:
                raise Violation(f"saved tensor keys {sorted(tensors)!r}, the checkpoint has {sorted(stored)!r}")
            for k in tensors:
                if not _same_tensor(c[k][...], want[k]):
                    raise Violation(f"{k!r} read back differs")
            c.verify()

        attempt(results, "reopen", reopen)
        if template is not None:
            def reload() -> None:
                out = ucp_zarr.load(template(), ck)
                got = {leaf.key: _unwrap(leaf.value) for leaf in iter_leaves(out)}
                for k, v in want.items():
                    if not _same_value(got[k], v):
                        raise Violation(f"{k!r} loaded as {got[k]!r}, saved {v!r}")

            attempt(results, "load", reload)

    report = isolated(work, watch=box)
    after = _entries(box)
    outside = sorted(
        p for p in set(before) ^ set(after) | {p for p in before if p in after and before[p] != after[p]}
        if p != "ck" and not p.startswith("ck" + os.sep)
    )
    found = problems_of(report, box=box, ck=ck, may_write=True, staging=overwrite)
    if outside:
        found.append(f"WRITE OUTSIDE THE CHECKPOINT: entries changed beside it: {outside[:10]}")
    if report.outcome("save") and report.outcome("save")["outcome"] == "ok":
        for p in _entries(ck):
            if not all(_COMPONENT.fullmatch(c) for c in p.split(os.sep)):
                found.append(f"UNESCAPED NAME in the checkpoint: {p!r}")
    note(f"outcomes: {[(r['op'], r['outcome'], r.get('type')) for r in report.results]}")
    if found:
        raise AssertionError("\n".join(found))
    return report


def _template_of(sd: Any) -> Any:
    """The same structure, tensors zeroed and values replaced by placeholders."""
    if isinstance(sd, ucp_zarr.PerRank):
        return ucp_zarr.PerRank(_template_of(sd.value))
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: _template_of(v) for k, v in sd.items()}
    if isinstance(sd, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in sd):
        return [_template_of(v) for v in sd]
    return "placeholder"


TENSORS = st.one_of(
    st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 40)),
    st.just(torch.tensor(1.5, dtype=torch.bfloat16)),
    st.just(torch.ones(3, 2, dtype=torch.int64)),
    st.just(torch.tensor([True, False])),
)
_NO_SURROGATES = st.characters(exclude_categories=("Cs",))
_unicode_text = st.one_of(
    st.sampled_from([h for h in HOSTILE_NAMES if not any(0xD800 <= ord(c) <= 0xDFFF for c in h)]), st.text(_NO_SURROGATES, max_size=12)
)
"""Text that is Unicode (no surrogate code points: test_save_values_with_surrogate_pairs)."""


def _tuples_of(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Tuples, and str-keyed dicts inside tuples (a dict or list directly would be walked)."""
    return st.one_of(st.lists(children, max_size=3).map(tuple), st.tuples(st.dictionaries(_unicode_text, children, max_size=2)))


ROUND_TRIP_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), _unicode_text, st.binary(max_size=8)), _tuples_of, max_leaves=6
) | st.lists(st.one_of(st.none(), st.integers(), _unicode_text), max_size=3)
SAFE_KEY_PIECES = ["..", ".", "/", "\\", "~", "\x00", "\n", "\x7f", "a", "é", "\u202e", "%", "$", "zarr.json",
                   ".ucp_zarr_pending", ".ucp_zarr_replace", "c", "0", "__", " ", "\U0001f600", "state"]


def _escaped_len(key: str) -> int:
    """Bytes of the longest name ucp_zarr derives from ``key`` (every character outside
    ``[A-Za-z0-9_.-]`` becomes ``%XX`` per UTF-8 byte)."""
    return sum(1 if re.fullmatch(r"[A-Za-z0-9_.\-]", c) else 3 * len(c.encode("utf-8", "surrogatepass")) for c in key)


hostile_keys = st.one_of(
    st.sampled_from([h for h in HOSTILE_NAMES if not any(0xD800 <= ord(c) <= 0xDFFF for c in h)]),
    st.text(_NO_SURROGATES, max_size=24),
    st.lists(st.sampled_from(SAFE_KEY_PIECES), min_size=1, max_size=8).map("".join),
).filter(lambda k: _escaped_len(k) <= 200)  # longer: test_save_long_keys


@_settings(30)
@given(keys=st.lists(hostile_keys, min_size=1, max_size=3, unique=True), values=st.lists(st.one_of(TENSORS, ROUND_TRIP_VALUES), min_size=3, max_size=3),
       nest=st.sampled_from([None, "model", "optim.state"]), overwrite=st.booleans())
def test_save_hostile_keys(keys: list[str], values: list[Any], nest: str | None, overwrite: bool) -> None:
    """Keys with ``..``, ``/``, absolute paths, NUL and control characters, odd unicode,
    reserved names (below the file system's name length): saved as escaped names inside the
    checkpoint, nothing created beside it, and read back exactly (or an error of the
    hierarchy). With ``overwrite`` over a committed checkpoint, the staging sibling is gone
    afterwards and the old checkpoint stays intact where the save fails."""
    leaves = dict(zip(keys, values))
    if nest == "model":
        sd_: dict[str, Any] = {"model": leaves}
    elif nest == "optim.state":
        sd_ = {"optim": {"state": leaves}}
    else:
        sd_ = leaves
    with sandbox() as (box, ck):
        if overwrite:
            ucp_zarr.save({"old": torch.ones(2)}, ck)
        report = save_in_child(box, ck, lambda: sd_, overwrite=overwrite, template=lambda: _template_of(sd_))
        if report.outcome("save")["outcome"] == "ok":
            assert report.outcome("reopen")["outcome"] == "ok" and report.outcome("load")["outcome"] == "ok"
        elif overwrite:
            assert torch.equal(ucp_zarr.open(ck)["old"][...], torch.ones(2))


@_settings(20)
@example(text="\ud800\udc00", as_key=False)
@given(text=st.tuples(st.characters(min_codepoint=0xD800, max_codepoint=0xDBFF), st.characters(min_codepoint=0xDC00, max_codepoint=0xDFFF)).map("".join),
       as_key=st.booleans())
def test_save_values_with_surrogate_pairs(text: str, as_key: bool) -> None:
    """Saved exactly, or refused with NotJSONableError; never loaded back as another string."""
    value = ({text: 1},) if as_key else text
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"v": value, "w": torch.ones(1)}, template=lambda: {"v": None, "w": torch.zeros(1)})
        expect(report, "save", "NotJSONableError", allow_ok=True)


@_settings(20)
@example(key="a\ud800")
@given(key=st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3).flatmap(lambda s: st.sampled_from([s, "w." + s, s + "/x"])))
def test_save_unencodable_keys(key: str) -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {key: torch.ones(2)})
        expect(report, "save", "NotJSONableError", "LayoutError", "KeyMismatchError", "FormatError", allow_ok=True)


@_settings(20)
@example(n=300, piece="k")
@given(n=st.integers(86, 5000), piece=st.sampled_from(["k", "é", "/", "\U0001f600", "ab.cd."]))
def test_save_long_keys(n: int, piece: str) -> None:
    """Very long keys: saved (a long name is a valid key) or refused before anything is
    written; never an OSError."""
    key = piece * n
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {key: torch.ones(2), "v" + key: 1}, template=lambda: {key: torch.zeros(2), "v" + key: 0})
        expect(report, "save", "NotJSONableError", "LayoutError", "KeyMismatchError", allow_ok=True)


@_settings(30)
@example(prefix="a", suffix="b", tensor_first=True)
@given(prefix=st.text(_NO_SURROGATES, min_size=1, max_size=5), suffix=st.text(_NO_SURROGATES, min_size=1, max_size=5),
       tensor_first=st.booleans())
def test_save_colliding_keys(prefix: str, suffix: str, tensor_first: bool) -> None:
    """``{"a.b": x, "a": {"b": y}}``: refused with an error of the hierarchy naming the key,
    before anything is written."""
    x, y = (torch.ones(2), 1) if tensor_first else (1, torch.ones(2))
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {f"{prefix}.{suffix}": x, prefix: {suffix: y}})
        expect(report, "save", "LayoutError", "KeyMismatchError", "NotJSONableError", "FormatError")
        assert not ck.exists()


@_settings(10)
@example(key=1)
@given(key=st.one_of(st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False)))
def test_save_non_str_key_colliding_with_its_str(key: Any) -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {key: torch.ones(2), str(key): torch.zeros(2)})
        expect(report, "save", "LayoutError", "KeyMismatchError", "NotJSONableError")


@_settings(15)
@given(keys=st.lists(st.one_of(st.integers(), st.none(), st.booleans(), st.tuples(st.integers(0, 3), st.text(max_size=2)),
                               st.floats(allow_nan=False), st.frozensets(st.integers(0, 2), max_size=2)),
                     min_size=1, max_size=3, unique_by=str))
def test_save_non_str_mapping_keys(keys: list[Any]) -> None:
    """Mapping keys that are not strings are flattened with ``str()`` (as DCP does): saved,
    read back under that name, loaded into a state dict with the same keys."""
    sd_ = {"m": {k: torch.full((2,), float(i)) for i, k in enumerate(keys)}}
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: sd_, template=lambda: _template_of(sd_))
        assert [r["outcome"] for r in report.results] == ["ok", "ok", "ok"], report.results


class _Obj:
    pass


UNSUPPORTED = [
    object(), {1, 2}, frozenset(), len, lambda: 0, torch.float32, torch.device("cpu"), np.zeros(3), np.zeros((2, 2)),
    1j, complex(1, 2), _Obj(), _Obj, Path("/etc"), range(3), b"x".decode, ucp_zarr.PerRank(ucp_zarr.PerRank(1)),
    (torch.ones(1),), [{"a": object()}], {"a": 1}.keys(), memoryview(b"xy"), Ellipsis, NotImplemented,
    torch.nn.Linear(1, 1), np.dtype("f4"), ({1: 2},), (b"x", {2: "y"}), __import__("decimal").Decimal("1.5"),
    __import__("fractions").Fraction(1, 3), ucp_zarr.PerRank(ucp_zarr.Shard(torch.ones(2), (2,), (0,))),
]


@_settings(30)
@given(value=st.sampled_from(range(len(UNSUPPORTED))), where=st.sampled_from(["top", "nested", "list", "per-rank"]))
def test_save_unsupported_values(value: int, where: str) -> None:
    """Objects, sets, functions, dtypes, devices, numpy arrays, complex numbers, modules,
    Decimal/Fraction, tensors inside tuples, non-str keys inside JSON values: refused with
    an error of the hierarchy naming the key, before anything is written."""
    v = UNSUPPORTED[value]
    sd_: dict[str, Any] = {
        "top": {"bad": v, "w": torch.ones(2)},
        "nested": {"a": {"b": {"bad": v}}, "w": torch.ones(2)},
        "list": {"l": [{"x": 1}, {"bad": v}], "w": torch.ones(2)},
        "per-rank": {"bad": ucp_zarr.PerRank(v), "w": torch.ones(2)},
    }[where]
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: sd_, roundtrip=False)
        expect(report, "save", "NotJSONableError", "DtypeMismatchError", "LayoutError")
        assert "bad" in report.outcome("save")["detail"]
        assert not ck.exists(), "nothing may be written before validation"


def _unsupported_tensor(kind: str) -> torch.Tensor:
    if kind == "sparse":
        return torch.eye(3).to_sparse()
    if kind == "sparse_csr":
        return torch.eye(3).to_sparse_csr()
    if kind == "meta":
        return torch.empty(3, device="meta")
    if kind == "nested":
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    if kind == "complex32":
        return torch.zeros(2, dtype=torch.complex32)
    if kind == "quint8":
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    raise AssertionError(kind)


@_settings(12)
@example(kind="sparse")
@given(kind=st.sampled_from(["sparse", "sparse_csr", "meta", "nested", "complex32", "quint8"]))
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_save_unsupported_tensor_kinds(kind: str) -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"t": _unsupported_tensor(kind)}, roundtrip=False)
        expect(report, "save", "DtypeMismatchError", "LayoutError", "NotJSONableError")


def _deep(kind: str, depth: int) -> Any:
    if kind == "cycle-dict":
        d: dict[str, Any] = {}
        d["self"] = d
        return d
    if kind == "cycle-list":
        loop: list[Any] = [torch.ones(1)]
        loop.append(loop)
        return loop
    v: Any = 1
    for _ in range(depth):
        v = {"d": v} if kind == "dict" else (v,) if kind == "tuple" else [v] if kind == "list" else [v, torch.ones(1)]
    return v


@_settings(10)
@example(kind="cycle-dict", depth=0)
@given(kind=st.sampled_from(["cycle-dict", "cycle-list", "dict", "tuple", "list", "tensor-list"]), depth=st.integers(3_000, 20_000))
def test_save_deep_and_cyclic_values(kind: str, depth: int) -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"v": _deep(kind, depth)}, roundtrip=False)
        expect(report, "save", "NotJSONableError", "LayoutError")


@dataclass(frozen=True)
class Geometry:
    flat: bool
    local: tuple[int, ...]
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]

    def value(self) -> Any:
        local = torch.arange(math.prod(self.local), dtype=torch.float32).reshape(self.local)
        if self.flat:
            return ucp_zarr.FlatShard(local, self.global_shape, self.offset[0] if self.offset else 0)
        return ucp_zarr.Shard(local, self.global_shape, self.offset)

    def valid(self) -> bool:
        """Exactly when a single rank's fragment is the whole tensor, inside its bounds."""
        numel = math.prod(self.global_shape)
        if self.flat:
            off = self.offset[0] if self.offset else 0
            return len(self.local) == 1 and off == 0 and self.local[0] == numel
        return (len(self.local) == len(self.global_shape) == len(self.offset)
                and all(o >= 0 and o + n <= g for o, n, g in zip(self.offset, self.local, self.global_shape))
                and math.prod(self.local) == numel)


def geometries(low: int) -> st.SearchStrategy[Geometry]:
    dims = st.integers(low, 5)
    return st.builds(Geometry, st.booleans(), st.lists(st.integers(0, 5), max_size=3).map(tuple),
                     st.lists(dims, max_size=3).map(tuple), st.lists(dims, max_size=3).map(tuple))


@_settings(40)
@given(g=geometries(0))
@example(g=Geometry(False, (2, 3), (4, 3), (3, 0)))
@example(g=Geometry(True, (6,), (2, 3), (1,)))
@example(g=Geometry(True, (2, 3), (2, 3), (0,)))
def test_save_shard_geometry(g: Geometry) -> None:
    """``Shard``/``FlatShard`` with inconsistent shapes and offsets (ranks that differ, a
    fragment outside the tensor or not covering it): LayoutError. Consistent ones save and
    read back."""
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"w": g.value()}, roundtrip=False)
        if g.valid():
            assert report.outcome("save")["outcome"] == "ok", report.results
            assert torch.equal(ucp_zarr.open(ck)["w"][...].reshape(-1), torch.arange(math.prod(g.global_shape), dtype=torch.float32))
        else:
            expect(report, "save", "LayoutError")
            assert not (ck / "zarr.json").exists()


def _negative(g: Geometry) -> bool:
    """A negative size, or a negative offset that the fragment uses (a FlatShard uses only
    the first: ``Geometry(True, (1,), (), (0, -1))`` is a valid 0-d tensor)."""
    used = g.offset[:1] if g.flat else g.offset
    return any(n < 0 for n in g.global_shape + used)


@_settings(30)
@example(g=Geometry(False, (2, 3), (2, 3), (-1, 0)))
@given(g=geometries(-3).filter(_negative))
def test_save_negative_shard_geometry(g: Geometry) -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"w": g.value()}, roundtrip=False)
        expect(report, "save", "LayoutError")


LOSSLESS = {
    ("float32", "float64"), ("bfloat16", "float32"), ("bfloat16", "float64"), ("int32", "int64"), ("int32", "float64"),
    ("uint8", "int16"), ("uint8", "int32"), ("uint8", "int64"), ("uint8", "float16"), ("uint8", "bfloat16"),
    ("uint8", "float32"), ("uint8", "float64"),
} | {("bool", d) for d in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "uint8")}
"""Source -> destination dtypes that keep every value (written out by hand, not computed)."""
DTYPES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "uint8", "bool"]


@_settings(100)
@given(key=st.sampled_from(sorted(ORIGINAL_TENSORS)), shape=st.one_of(st.none(), st.lists(st.integers(0, 17), max_size=3)),
       dtype=st.one_of(st.none(), st.sampled_from(DTYPES)), lossy=st.booleans(), form=st.sampled_from(["tensor", "shard", "value"]))
def test_load_shape_and_dtype_mismatch(key: str, shape: list[int] | None, dtype: str | None, lossy: bool, form: str) -> None:
    """Loading into a tensor of another shape: ShapeMismatchError; of another dtype: fine when
    the cast keeps every value, else DtypeMismatchError unless ``allow_lossy_cast`` (float32
    -> bfloat16 needs it); a value where a tensor was saved: DtypeMismatchError. Nothing is
    unpickled. Runs in this process: the checkpoint is intact."""
    orig = ORIGINAL_TENSORS[key]
    src = str(orig.dtype).removeprefix("torch.")
    dst = dtype or src
    new_shape = tuple(shape) if shape is not None else tuple(orig.shape)
    template = make_state(True)
    leaf = next(lf for lf in iter_leaves(template) if lf.key == key)  # (keys contain dots)
    parts = list(leaf.path)
    holder: Any = template
    for p in parts[:-1]:
        holder = holder[p]
    target = torch.zeros(new_shape, dtype=getattr(torch, dst))
    if form == "shard" and len(new_shape) >= 1:
        value: Any = ucp_zarr.Shard(target, new_shape, (0,) * len(new_shape))
    elif form == "value":
        value = 0
    else:
        value = target
    wrapped = isinstance(holder[parts[-1]], ucp_zarr.PerRank)
    holder[parts[-1]] = ucp_zarr.PerRank(value) if wrapped else value
    with no_unpickling():
        try:
            ucp_zarr.load(template, base().unsigned, allow_lossy_cast=lossy)
            outcome: Any = None
        except CheckpointError as e:
            outcome = e
        except BaseException as e:  # noqa: BLE001
            raise AssertionError(f"foreign exception {type(e).__name__}: {e}") from e
    if form == "value":
        assert isinstance(outcome, ucp_zarr.DtypeMismatchError), outcome
    elif new_shape != tuple(orig.shape):
        assert isinstance(outcome, ucp_zarr.ShapeMismatchError), outcome
        assert repr(key) in str(outcome)
    elif dst != src and (src, dst) not in LOSSLESS and not lossy:
        assert isinstance(outcome, ucp_zarr.DtypeMismatchError), outcome
        assert "allow_lossy_cast" in str(outcome)
    else:
        assert outcome is None, outcome
        got = _unwrap(holder[parts[-1]])
        got = got.local if isinstance(got, ucp_zarr.Shard) else got
        assert got.dtype == getattr(torch, dst)
        assert torch.equal(got, orig.to(getattr(torch, dst)))


def test_lossy_cast_float32_to_bfloat16_needs_opt_in() -> None:
    t = {"w": torch.zeros(16, 12, dtype=torch.bfloat16)}
    with sandbox() as (box, ck):
        ucp_zarr.save({"w": ORIGINAL_TENSORS["model.layers.0.weight"]}, ck)
        with pytest.raises(ucp_zarr.DtypeMismatchError, match="allow_lossy_cast"):
            ucp_zarr.load(t, ck)
        ucp_zarr.load(t, ck, allow_lossy_cast=True)
        assert torch.equal(t["w"], ORIGINAL_TENSORS["model.layers.0.weight"].bfloat16())


# === 5. not a checkpoint =======================================================================

TREE_NAMES = st.one_of(
    st.sampled_from(["a", "b", "c", "0", ".hidden", ".ucp_zarr_pending", ".ucp_zarr_heartbeat.x", ".ucp_zarr_takeover.y",
                     "weird name", "é", "zarr.json.bak", "%2E", "ZARR.JSON", "zarr.json.tmp-1", "\\", "~"]),
    st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=8).filter(lambda s: s not in (".", "..")),
)


def _directories(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(TREE_NAMES, children, max_size=4)


trees = st.recursive(st.binary(max_size=48), _directories, max_leaves=8).filter(lambda t: isinstance(t, dict))


def _make_tree(root: Path, tree: dict[str, Any], top: bool = True) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, sub in tree.items():
        if top and name in ("zarr.json", ".ucp_zarr_replace"):
            continue  # a root document / replace record: covered where their content is tested
        with contextlib.suppress(OSError):
            if isinstance(sub, dict):
                _make_tree(root / name, sub, top=False)
            else:
                (root / name).write_bytes(sub)


def _has_files(root: Path) -> bool:
    return any(files for _, _, files in os.walk(root))


@_settings(45)
@given(tree=trees, exists=st.booleans())
def test_open_not_a_checkpoint(tree: dict[str, Any], exists: bool) -> None:
    """A directory that is no checkpoint -- missing, empty, random files and directories,
    a leftover marker with garbage -- gives NotACheckpointError (nothing there) or
    IncompleteCheckpointError (something there, no commit record), from open and load."""
    with sandbox() as (box, ck):
        if exists:
            _make_tree(ck, tree)
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        marker = (ck / ".ucp_zarr_pending").exists()  # (a leftover marker, even as a directory)
        want = "IncompleteCheckpointError" if exists and (_has_files(ck) or marker) else "NotACheckpointError"
        expect(report, "open", want)
        expect(report, "load", want)


@pytest.mark.parametrize("below", [False, True])
def test_open_a_file_instead_of_a_directory(below: bool) -> None:
    with sandbox() as (box, ck):
        ck.write_bytes(b"not a directory")
        path = ck / "sub" if below else ck
        report = isolated(lambda results: (
            attempt(results, "open", lambda: ucp_zarr.open(path)),
            attempt(results, "load", lambda: ucp_zarr.load({}, path)),
            attempt(results, "save", lambda: ucp_zarr.save({"w": torch.ones(1)}, path)),
        ), watch=box)
        check(report, box=box, ck=ck, may_write=True)
        expect(report, "open", "NotACheckpointError")
        expect(report, "load", "NotACheckpointError")
        expect(report, "save", "CheckpointExistsError", "NotACheckpointError")




@pytest.mark.parametrize("name", ["zarr.json", ".ucp_zarr_replace",
                                  ".ucp_zarr_pending", ".ucp_zarr_heartbeat.x"])
def test_open_directory_where_a_record_belongs(name: str) -> None:
    with sandbox() as (box, ck):
        (ck / name).mkdir(parents=True)
        report = read_in_child(ck, box)
        check(report, box=box, ck=ck)
        expect(report, "open", "FormatError", "IncompleteCheckpointError", "NotACheckpointError")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "fifo-array-doc"])
def test_open_special_files(kind: str) -> None:
    with sandbox(base().unsigned if kind == "fifo-array-doc" else None) as (box, ck):
        ck.mkdir(exist_ok=True)
        target = ck / ("layers.0.weight/model/zarr.json" if kind == "fifo-array-doc" else "zarr.json")
        target.unlink(missing_ok=True)
        if kind.startswith("fifo"):
            os.mkfifo(target)
        else:
            target.symlink_to("/dev/zero")
        report = read_in_child(ck, box, timeout=1.0, headroom=256 << 20)
        check(report, box=box, ck=ck)
        if kind == "fifo-array-doc":  # reads use the root's consolidated copy; verify reads the object
            expect_ok(report, "read 'model.layers.0.weight'")
            expect(report, "verify", "CorruptChunkError", "FormatError")
        else:
            expect(report, "open", "FormatError", "IncompleteCheckpointError")


@pytest.mark.parametrize("staged", ["victim", "ABSOLUTE", "../victim"])
def test_replace_record_cannot_redirect_or_delete(staged: str) -> None:
    with sandbox() as (box, ck):
        victim = box / "victim"
        ucp_zarr.save({"secret": torch.arange(3.0)}, victim)
        ck.mkdir()
        record = {"save_id": "0" * 32, "host": "", "boot_id": "", "pid": -1, "pid_start": None, "started": 0.0,
                  "lease_s": 0.0, "staged": str(victim) if staged == "ABSOLUTE" else staged}
        (ck / ".ucp_zarr_replace").write_text(json.dumps(record))
        report = isolated(lambda results: (
            attempt(results, "open", lambda: ucp_zarr.open(ck)),
            attempt(results, "save", lambda: ucp_zarr.save({"w": torch.ones(1)}, ck)),
        ), watch=box)
        check(report, box=box, ck=ck, may_write=True)
        assert victim.is_dir() and (victim / "zarr.json").exists(), "the save deleted a directory beside the checkpoint"
        expect(report, "open", "IncompleteCheckpointError", "FormatError")


# === regression tests: minimal reproductions of the bugs found (one per bug) =====================================


def _root_with(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def edit(attrs: dict[str, Any]) -> None:
        for k, v in changes.items():
            attrs[k] = v

    return edit


def _repro_reader(edit: Callable[[dict[str, Any]], None] | None = None, raw: bytes | None = None, **kw: Any) -> None:
    __tracebackhide__ = True  # (pytest reports the caller's line)
    with sandbox(base().unsigned) as (box, ck):
        if raw is not None:
            (ck / "zarr.json").write_bytes(raw)
        if edit is not None:
            doc = copy.deepcopy(base().docs["root"])
            edit(doc["attributes"]["ucp_zarr"])
            write_json(ck / "zarr.json", doc)
        check(read_in_child(ck, box, **kw), box=box, ck=ck)


def test_bug_world_size_infinity() -> None:
    _repro_reader(_root_with(world_size=math.inf))


def test_bug_world_size_zero_per_rank() -> None:
    def edit(a: dict[str, Any]) -> None:
        a["world_size"] = 0
        a["rank_values"]["loader"] = {"1": {"epoch": 1, "pos": 17}}

    _repro_reader(edit)


def test_bug_world_size_huge_per_rank() -> None:
    def edit(a: dict[str, Any]) -> None:
        a["world_size"] = 2**40
        a["rank_values"]["loader"] = {"1": {"epoch": 1, "pos": 17}}

    _repro_reader(edit)


def test_bug_deeply_nested_root() -> None:
    _repro_reader(raw=b"[" * 100_000 + b"]" * 100_000)


@pytest.mark.parametrize("value", [{"$float": "nope"}, {"$bytes": 5}, {"$bytes": "a"}, {"$tuple": 1}, {"$float": []}])
def test_bug_undecodable_value_tags(value: Any) -> None:
    _repro_reader(lambda a: a["values"].__setitem__("step", value), values_intact=False)


@pytest.mark.parametrize("name", ["layers.0.weight/model", "a/\x00", "a/\ud800", "layers.0.weight/" + "x" * 300])
def test_bug_documents_member_not_a_file(name: str) -> None:
    _repro_reader(lambda a: a["documents"].__setitem__(name, "sha256:" + "0" * 64))


def test_bug_documents_member_outside() -> None:
    _repro_reader(lambda a: a["documents"].__setitem__("../secret", digest(b"secret")))


def test_bug_long_array_path() -> None:
    def edit(a: dict[str, Any]) -> None:
        a["tensors"]["model.scale"]["path"] = "s" * 300 + "/model"
        a["documents"]["s" * 300 + "/model/zarr.json"] = "sha256:" + "0" * 64

    _repro_reader(edit)


def test_bug_save_surrogate_key() -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"a\ud800": torch.ones(2)})
        expect(report, "save", "NotJSONableError", "LayoutError", allow_ok=True)


def test_bug_save_long_key() -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"k" * 300: torch.ones(2)}, template=lambda: {"k" * 300: torch.zeros(2)})
        expect(report, "save", "LayoutError", allow_ok=True)


def test_bug_save_colliding_keys() -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})
        expect(report, "save", "LayoutError", "KeyMismatchError", "NotJSONableError")


def test_bug_save_cyclic_state_dict() -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"v": _deep("cycle-dict", 0)}, roundtrip=False)
        expect(report, "save", "NotJSONableError", "LayoutError")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["sparse", "meta", "nested"])
def test_bug_save_unsupported_tensor_kind(kind: str) -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"t": _unsupported_tensor(kind)}, roundtrip=False)
        expect(report, "save", "DtypeMismatchError", "LayoutError", "NotJSONableError")


def test_bug_bool_fill_value_list() -> None:
    with sandbox(base().unsigned) as (box, ck):
        doc = "mask/model/zarr.json"
        rewrite_array_doc(ck, doc, dict(base().docs[doc], fill_value=[]), redigest=True)
        check(read_in_child(ck, box), box=box, ck=ck)


def test_bug_array_meta_cache_aliasing() -> None:
    """'model.scale' indexed at the array of 'optim.state.layers.0.weight.step' (both 0-d
    float32): after reading the step, ck['model.scale'][...] returned the step's 7.0."""
    with sandbox(base().unsigned) as (box, ck):
        mutate_root(ck, ("replace", ROOT + ("tensors", "model.scale", "path"), "layers.0.weight/optim.step"))

        def work(results: list[dict[str, Any]]) -> None:
            c = attempt(results, "open", lambda: ucp_zarr.open(ck))
            if c is not None:
                c["optim.state.layers.0.weight.step"][...]
                attempt(results, "read 'model.scale'", lambda: _check_tensor("model.scale", c["model.scale"][...]))

        report = isolated(work, watch=box)
        check(report, box=box, ck=ck)
        expect(report, "open", "FormatError")


def test_bug_signed_record_with_nan() -> None:
    _signed_root_mutation(("replace", ROOT + ("values", "step"), math.nan))


def test_bug_forged_huge_shape() -> None:
    test_forged_shape_in_root_and_array_document.hypothesis.inner_test(doc="ids/model/zarr.json", shape=[2**62])


def test_bug_save_surrogate_pair_value() -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"v": "\ud800\udc00"}, template=lambda: {"v": None})
        expect(report, "save", "NotJSONableError", allow_ok=True)


def test_bug_save_non_str_key_collision() -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {1: torch.ones(1), "1": torch.ones(1)})
        expect(report, "save", "LayoutError", "KeyMismatchError", "NotJSONableError")


def test_bug_save_negative_shard_offset() -> None:
    with sandbox() as (box, ck):
        report = save_in_child(box, ck, lambda: {"w": ucp_zarr.Shard(torch.ones(2, 3), (2, 3), (-1, 0))}, roundtrip=False)
        expect(report, "save", "LayoutError")


# --- the module as a whole ------------------------------------------------------------------------


def test_zz_this_process_stayed_small() -> None:
    """The examples ran in other processes (each job checked by its own peak RSS); this
    process's peak RSS (ru_maxrss) did not jump by more than a few hundred MiB across the module."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    growth = peak - base().peak_rss_at_start
    assert growth < MEMORY_GROWTH_LIMIT, f"peak RSS grew by {growth >> 20} MiB during this module"


# --- damaged or crafted checkpoints: memory, partial fills, signed duplicates -----------------


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_document_larger_than_any_checkpoints_is_refused_before_it_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A commit record or array document padded to gigabytes (a sparse file costs no disk) was
    read whole: a MemoryError, or the OOM killer, in place of an error naming the file."""
    import ucp_zarr.io.store as store_module

    path = str(tmp_path / "ck") if where == "local" else f"memory://big_docs_{uuid.uuid4().hex}/ck"
    ucp_zarr.save({"w": torch.ones(4)}, path)
    opened = ucp_zarr.open(path)
    monkeypatch.setattr(store_module, "MAX_DOCUMENT_BYTES", 64)  # (every document of this checkpoint is larger)
    with pytest.raises(FormatError, match=r"zarr.json has [0-9,]+ bytes, more than any document of a checkpoint"):
        ucp_zarr.open(path)
    with pytest.raises(FormatError, match=r"w/w/zarr.json has"):
        opened.verify()


def test_a_sparse_gigabyte_record_is_refused_without_reading_it(tmp_path: Path) -> None:
    ucp_zarr.save({"w": torch.ones(4)}, tmp_path / "ck")
    root = tmp_path / "ck" / "zarr.json"
    with open(root, "r+b") as f:
        f.truncate(root.stat().st_size + (3 << 30))
    code = textwrap.dedent(f"""
        import resource, ucp_zarr
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        try:
            ucp_zarr.open({str(tmp_path / "ck")!r})
        except ucp_zarr.FormatError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "refused:" in out.stdout and "more than any document" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_tensor_too_large_for_memory_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's and torch's allocation errors named neither the tensor nor the checkpoint."""
    import numpy as np

    ucp_zarr.save({"model": {"w": torch.ones(4, 4)}}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("Unable to allocate 984. GiB")

    monkeypatch.setattr(np, "empty", refuse)
    with pytest.raises(MemoryError, match=r"tensor 'model.w': 64 bytes \(shape \[4, 4\]\) do not fit in memory"):
        ck["model.w"][...]
    monkeypatch.undo()

    def allocator(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "empty", allocator)
    with pytest.raises(MemoryError, match=r"tensor 'model.w'"):
        ucp_zarr.read_state_dict(tmp_path / "ck")


def test_a_corrupt_chunk_met_by_a_load_says_the_state_dict_was_partly_filled(tmp_path: Path) -> None:
    """Chunks are read straight into their targets: the one found corrupt, and those before it,
    are in the caller's tensors when the error is raised (a caller that goes on trains on a
    mix of its own, saved and corrupt values): the error says so."""
    w = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    ucp_zarr.save({"w": w}, tmp_path / "ck", chunk_bytes=1024, shard_bytes=4096)
    last = sorted((tmp_path / "ck" / "w" / "w" / "c").iterdir())[-1]
    shard = last / "0" if last.is_dir() else last
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x40
    shard.write_bytes(bytes(raw))
    mine = torch.full((64, 64), -1.0)
    with pytest.raises(CorruptChunkError, match=r"crc32c mismatch.*partly filled|crc32c mismatch.*filled part of the state dict"):
        ucp_zarr.load({"w": mine}, tmp_path / "ck")
    assert not torch.equal(mine, torch.full((64, 64), -1.0))  # (what the message warns of)


def test_a_signed_record_naming_a_member_twice_is_refused(tmp_path: Path) -> None:
    """JSON readers differ in which of two same-named members they take (Python: the last,
    which the signature covers; others: the first): with the key, such a record is refused."""
    key = b"k" * 32
    ucp_zarr.save({"w": torch.ones(2), "step": 100}, tmp_path / "ck", hmac_key=key)
    root = tmp_path / "ck" / "zarr.json"
    raw = root.read_bytes()
    assert raw.count(b'"step":100') == 1
    root.write_bytes(raw.replace(b'"step":100', b'"step":666,"step":100'))
    with pytest.raises(FormatError, match="'step' is named twice"):
        ucp_zarr.open(tmp_path / "ck", hmac_key=key)
