"""Page-cache helpers shared by the benchmarks: cold loads for every method alike."""

from __future__ import annotations

import os
import shutil
import subprocess


def files_under(path: str) -> list[str]:
    """``path`` itself if it is a file, else every file below it."""
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _, names in os.walk(path):
        out.extend(os.path.join(root, n) for n in names)
    return out


def evict(*paths: str) -> None:
    """fsync and drop from the page cache every file under ``paths``."""
    for p in paths:
        for f in files_under(p):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cached_bytes(path: str) -> int | None:
    """Bytes of ``path``'s files still in the page cache (util-linux ``fincore``), or None."""
    files = files_under(path)
    if not files or shutil.which("fincore") is None:
        return None
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *files], capture_output=True, text=True, check=True
        ).stdout
    except (subprocess.CalledProcessError, OSError):
        return None
    return sum(int(x) for x in out.split())
