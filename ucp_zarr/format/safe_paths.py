"""Paths built from names found in input data: one helper builds them all, none leaves its folder.

Converters and exporters make file names from what a checkpoint holds: parameter names
(a DeepSpeed universal folder is ``zero/<name>/<key>.pt``), the tag a ``latest`` file
names, the shard files a safetensors index or a DCP ``.metadata`` lists. Such a name is
data, written by whoever made the file. :func:`inside` and :func:`inside_relative` are the
only way this package turns one into a path, and they refuse, with
:class:`~ucp_zarr.errors.UnsafePathError` naming the name, where it came from and the
folder, any name that is not one plain file name on every system that may read it:

* empty, ``.`` or ``..``; holding ``/``, ``\\`` (Windows' separator) or ``:`` (a Windows
  drive letter or stream); an absolute path (:func:`inside_relative`);
* holding a control character (NUL, newline, ...) or a line or paragraph separator;
* longer than :data:`MAX_NAME_BYTES` bytes in UTF-8, or not valid Unicode;
* any of these once Unicode look-alikes are read as what they imitate: NFKC normalisation
  (FULLWIDTH SOLIDUS -> ``/``, ONE DOT LEADER -> ``.``, TWO DOT LEADER -> ``..``, ACCOUNT OF
  -> ``a/c``) and the "best fit" mappings of Windows code pages (DIVISION SLASH -> ``/``,
  YEN SIGN -> ``\\``).

Such names are refused, not escaped: each is the name another system (DeepSpeed, Hugging
Face, DCP) looks up, and any other spelling would be a file it does not find. (Keys stored
in a ucp_zarr checkpoint are escaped instead, by ``statedict.array_path``: any key is legal
there, and the root index records its path.)

Symbolic links: a path written (``write=True``) must not pass through one between the
folder and the file, nor be one (:func:`check_no_links`); :func:`check_no_links_under`
refuses a destination folder that already holds links. A path read follows the links its source folder holds itself
(the Hugging Face cache links each snapshot's files to its blobs): only names taken from
the data are checked there.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path
from typing import Any

from ..errors import UnsafePathError

MAX_NAME_BYTES = 255
"""The longest file name (in UTF-8 bytes) common file systems allow."""

_BEST_FIT = str.maketrans({
    "\u2215": "/", "\u2044": "/", "\u29f8": "/",  # DIVISION SLASH, FRACTION SLASH, BIG SOLIDUS
    "\u2216": "\\", "\u29f9": "\\",  # SET MINUS, BIG REVERSE SOLIDUS
    "\u00a5": "\\", "\u20a9": "\\",  # YEN SIGN (code page 932), WON SIGN (949): the backslash's byte there
})
"""Characters Windows' "best fit" code-page conversions turn into separators (NFKC leaves them)."""
_SEPARATORS = {"/": "a path separator", "\\": "Windows' path separator",
               ":": "which Windows reads as a drive letter or a stream"}
_CONTROL = {"Cc", "Zl", "Zp"}


def name_problem(name: Any) -> str | None:
    """Why ``name`` is not one plain file name (see the module's rules), or None when it is."""
    if not isinstance(name, str):
        return f"it is a {type(name).__name__}, not a string"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "it is not valid Unicode (it holds surrogate code points)"
    if size > MAX_NAME_BYTES:
        return f"it is {size} bytes long in UTF-8; a file name has at most {MAX_NAME_BYTES}"
    problem = _plain_problem(name)
    if problem is not None:
        return problem
    folded = unicodedata.normalize("NFKC", name).translate(_BEST_FIT)
    problem = _plain_problem(folded)
    if problem is not None:
        return (f"read as {folded[:100]!r} (Unicode look-alikes as what they imitate: NFKC normalisation, "
                f"Windows best-fit code pages), {problem}")
    return None


def _plain_problem(name: str) -> str | None:
    if name == "":
        return "it is empty"
    if name in (".", ".."):
        return f"it is {name!r}, {'the folder itself' if name == '.' else 'the parent folder'}"
    for c, what in _SEPARATORS.items():
        if c in name:
            return f"it holds {c!r}, {what}"
    bad = next((c for c in name if unicodedata.category(c) in _CONTROL), None)
    if bad is not None:
        return f"it holds the control character U+{ord(bad):04X}"
    return None


def check_name(name: Any, what: str, root: Path | None = None) -> str:
    """``name`` if it is one plain file name, else :class:`UnsafePathError` saying
    ``what`` it is (``"parameter name in optim.param_groups of checkpoint X"``)."""
    problem = name_problem(name)
    if problem is not None:
        raise _refused(name, what, problem, root)
    return name


def inside(root: Path, name: Any, what: str, *, write: bool = False) -> Path:
    """``root / name`` for ``name`` (one file name taken from the data, checked by
    :func:`check_name`). With ``write``, the path is also checked to pass through no
    symbolic link below ``root`` nor to be one (:func:`check_no_links`)."""
    path = Path(root) / check_name(name, what, root)
    if write:
        check_no_links(root, path, what)
    return path


def inside_relative(root: Path, relative: Any, what: str) -> Path:
    """``root`` joined with ``relative``, a ``/``-separated relative path taken from the
    data (a shard file a DCP ``.metadata`` names), each of whose parts is one plain file name."""
    if not isinstance(relative, str):
        raise _refused(relative, what, f"it is a {type(relative).__name__}, not a string", root)
    if relative.startswith(("/", "\\")):
        raise _refused(relative, what, "it is an absolute path", root)
    parts = relative.split("/")
    for part in parts:
        problem = name_problem(part)
        if problem is not None:
            raise _refused(relative, what, f"its part {part[:100]!r}: {problem}" if len(parts) > 1 else problem, root)
    return Path(root).joinpath(*parts)


def check_no_links(root: Path, path: Path, what: str) -> None:
    """Refuse (:class:`UnsafePathError`) a ``path`` below ``root`` that is, or passes
    through, a symbolic link below ``root`` (``root`` itself may be one: it is the caller's)."""
    root, path = Path(root), Path(path)
    parts = path.relative_to(root).parts
    at = root
    for part in parts:
        at = at / part
        if at.is_symlink():
            raise UnsafePathError(
                f"{what}: {at} is a symbolic link (to {os.readlink(at)!r}); nothing is written through a link "
                f"inside {root}, which could point anywhere: remove it or choose another folder"
            )
        if not at.exists():
            return


def check_no_links_under(root: Path, what: str) -> None:
    """Refuse (:class:`UnsafePathError`) a folder ``root`` about to be written into that
    already holds symbolic links (not following them; ``root`` itself may be one)."""
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        found += [os.path.join(folder, n) for n in dirs + files if os.path.islink(os.path.join(folder, n))]
    if found:
        raise UnsafePathError(
            f"{what}: {root} holds symbolic links ({', '.join(sorted(found)[:5])}{', ...' if len(found) > 5 else ''}); "
            "nothing is written through a link, which could point anywhere: remove them or choose another folder"
        )


def _refused(name: Any, what: str, problem: str, root: Path | None) -> UnsafePathError:
    shown = repr(name)
    shown = shown if len(shown) <= 200 else f"{shown[:200]}... ({len(shown)} characters)"
    where = "" if root is None else f" inside {root}"
    return UnsafePathError(f"{what} {shown} is refused as a file name: {problem}; a name read from the data must "
                           f"be one plain file name{where}")
