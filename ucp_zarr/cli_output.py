"""What the ucp-zarr commands share: their usage error, opening a checkpoint with the options given,
JSON output, progress bars and text tables."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Collection, Iterator, TYPE_CHECKING


if TYPE_CHECKING:
    from .browse.checkpoint import Checkpoint


class UsageError(Exception):
    """Bad input on the command line (a key, a selection): reported as ``error: ...``."""


# --- shared -------------------------------------------------------------------------------


def open_checkpoint(path: str, args: argparse.Namespace, *, others: tuple[str, ...] = ()) -> "Checkpoint":
    """The checkpoint at ``path``; ``--storage-options`` apply to it, unless it is a local path
    beside a remote one of the same command (``others``: ``diff LOCAL s3://...``)."""
    from .browse.checkpoint import open as open_committed

    options = None if not is_url(path) and any(is_url(o) for o in others) else args.storage_options
    return open_committed(path, storage_options=options, hmac_key=_key(args))


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote store (``--storage-options`` apply to those only)."""
    return "://" in path and not path.startswith("file://")


def _key(args: argparse.Namespace) -> bytes | None:
    if args.key_file is None:
        return None
    try:
        with open(args.key_file, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"cannot read the key file {args.key_file}: {e.strerror}") from None


def emit(data: Any) -> None:
    json.dump(data, sys.stdout, default=str, allow_nan=False)
    sys.stdout.write("\n")


class _Bar:
    """``progress(done, total)`` in bytes, drawn by tqdm on stderr from its first call."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.what, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
        self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def progress_bar(args: argparse.Namespace, what: str) -> Iterator[_Bar | None]:
    """A progress bar when stderr is a terminal (or with ``--progress``), else None."""
    if not (args.progress if args.progress is not None else sys.stderr.isatty()):
        yield None
        return
    bar = _Bar(what)
    try:
        yield bar
    finally:
        bar.close()


def format_table(header: list[str], rows: list[list[str]], right: Collection[int] = ()) -> str:
    """Aligned columns, one line per row: a control character in a cell (a key holding a
    newline) is written as its escape (``\\n``), so that no row spans two lines."""
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = [(str.rjust if i in right else str.ljust) for i in range(len(header))]
    lines = ["  ".join(f(c, w) for f, c, w in zip(fmt, r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def printable(cell: str) -> str:
    """``cell`` with every control character (an escape sequence of a key or value that would
    drive the terminal) written as its escape (``\\x1b``)."""
    if cell.isprintable():
        return cell
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in cell)


def format_num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)
