"""The exceptions ucp_zarr raises: one hierarchy under :class:`CheckpointError`.

Every error raised on bad input or bad data derives from :class:`CheckpointError`, and its
message names the tensor, key, rank or file involved. Where a builtin exception used to be
raised (``ValueError``, ``TypeError``, ``KeyError``, ``FileNotFoundError``,
``FileExistsError``), the class derives from it too, so existing handlers keep working.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Iterable


@dataclass(frozen=True)
class Keyword:
    """A keyword argument that an error message names (``overwrite=True``, ``source``).
    ``str()`` spells it as Python does; a face with other spellings (the command line:
    ``--overwrite``, ``--from``) renders it its own way (:func:`render`)."""

    name: str
    value: Any = ...
    """What to pass (``...``: the message names the keyword only)."""

    def __str__(self) -> str:
        return self.name if self.value is ... else f"{self.name}={self.value!r}"


class CheckpointError(Exception):
    """Base class of every error ucp_zarr raises on purpose.

    A message that names a keyword argument is given in parts, the keyword as a
    :class:`Keyword`: ``CheckpointExistsError(f"{url} exists; pass ", Keyword("overwrite", True))``.
    ``str(error)`` (and ``args[0]``) is the message as Python spells it; ``parts`` keeps
    the parts for :func:`render`."""

    parts: tuple[Any, ...] = ()

    def __init__(self, *args: Any) -> None:
        if any(isinstance(a, Keyword) for a in args):
            self.parts = args
            args = ("".join(map(str, args)),)
        super().__init__(*args)


def render(error: BaseException, spell: Callable[[Keyword], str] = str) -> str:
    """The message of ``error`` with each :class:`Keyword` it names spelled by ``spell``."""
    parts = getattr(error, "parts", ())
    if not parts:
        return str(error)
    return "".join(spell(p) if isinstance(p, Keyword) else str(p) for p in parts)


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'a', 'b'?)`` with up to three close candidates, or ``""``."""
    close = difflib.get_close_matches(word, list(candidates), n=3)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


# --- the checkpoint as a whole -------------------------------------------------------------


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The path holds no ucp_zarr checkpoint at all (nothing there, or something else)."""


class IncompleteCheckpointError(CheckpointError):
    """The path holds a checkpoint whose commit record was never written."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """Saving would replace a committed checkpoint (pass ``overwrite=True`` to allow it)."""


class OwnershipError(CheckpointError):
    """Another save owns the path (it is running, or not provably dead), or this save lost
    its ownership before committing."""


class SaveError(CheckpointError):
    """A distributed save failed, raised on every rank; or a distributed load failed on
    another rank (the failing rank raises its own error). ``failures`` maps each failing
    rank to its error."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


# --- bad input -----------------------------------------------------------------------------


class LayoutError(CheckpointError, ValueError):
    """The ranks' fragments of a tensor do not form a valid global layout (coverage,
    overlap, shapes, dtypes, or replicas that differ)."""


class ShapeMismatchError(CheckpointError, ValueError):
    """A tensor's shape in the state dict differs from the checkpoint's."""


class DtypeMismatchError(CheckpointError, TypeError):
    """A tensor's dtype cannot take the checkpoint's values (a lossy cast that was not
    allowed, or a tensor where the checkpoint holds a value, or the reverse)."""


class KeyMismatchError(CheckpointError, KeyError):
    """Keys missing from the checkpoint or unexpected in it (``strict=True``)."""

    def __init__(self, missing: list[str], unexpected: list[str]) -> None:
        self.missing = missing
        self.unexpected = unexpected
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state dict: {', '.join(unexpected)}")
        super().__init__("; ".join(parts))

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class PerRankStateError(CheckpointError, KeyError):
    """Per-rank state of this rank cannot be restored: the rank did not exist at save time
    (pass ``allow_new_ranks=True`` to keep the current values)."""

    def __str__(self) -> str:
        return str(self.args[0])


class OptionError(CheckpointError, ValueError):
    """A keyword argument that does not apply to the call, or a value it cannot take (the
    message names it)."""


class UnknownKeyError(CheckpointError, KeyError):
    """A checkpoint holds no tensor of that key (the message suggests close ones)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class NotJSONableError(CheckpointError, TypeError):
    """A non-tensor value in the state dict cannot be stored as JSON."""


# --- bad data ------------------------------------------------------------------------------


class FormatError(CheckpointError, ValueError):
    """A metadata document is missing, malformed, inconsistent, or uses something this
    library does not read (another codec chain, format version, byte order...)."""


class CorruptChunkError(CheckpointError):
    """Stored data is corrupt, missing, or does not belong to this checkpoint (failed
    crc32c, absent chunk, a shard from another array or another save)."""


class CheckpointReplacedError(CheckpointError):
    """The checkpoint being read was replaced (an overwrite committed) or deleted meanwhile:
    what the read missed belongs to another save, not to a corrupt checkpoint. Read again."""


class AuthenticationError(CorruptChunkError):
    """An authenticated checkpoint (``hmac_key``) failed its check, or a key was given and
    the checkpoint is unsigned: data, metadata or values were changed."""


class ConversionError(CheckpointError, ValueError):
    """A foreign checkpoint cannot be converted (unknown kind, missing or truncated file,
    inconsistent partitions); the message names the file."""


class UnsafePathError(ConversionError, FormatError):
    """A name taken from input data (a parameter name, a value of a checkpoint, a file
    named inside a foreign checkpoint or index) would make a path outside the folder it
    belongs in, or one that means something else on another system (``..``, a separator,
    a drive letter, a control character, a Unicode look-alike, over 255 bytes), or a path
    written would pass through a symbolic link; the message names the name, where it came
    from and the folder (see :mod:`ucp_zarr.format.safe_paths`)."""


class UntrustedInputError(ConversionError):
    """A foreign file needs full unpickling (arbitrary code) to be read; pass ``trust=True``
    (``--trust``) only for files from a source you trust."""


_AGREED: dict[type, type] = {}


def agreed_error(message: str, failures: dict[int, tuple[str, str]]) -> SaveError:
    """The error every rank raises when ``failures`` (rank -> (error class name, message))
    failed a collective step: a :class:`SaveError`, which is also an instance of the
    failing ranks' error class when they all failed with the same ucp_zarr error."""
    names = {name for name, _ in failures.values()}
    cls = _error_class(names.pop()) if len(names) == 1 else None
    if (not (isinstance(cls, type) and issubclass(cls, CheckpointError)) or issubclass(SaveError, cls)  # (CheckpointError)
            or cls in (SaveError, KeyMismatchError, PerRankStateError)):
        return SaveError(message, {r: f"{n}: {m}" for r, (n, m) in failures.items()})
    if cls not in _AGREED:
        # registered under its name in this module, so that it pickles (DCP gathers errors)
        name = f"Agreed{cls.__name__}"
        attrs = {"__module__": __name__, "__qualname__": name, "__doc__": cls.__doc__}
        _AGREED[cls] = globals()[name] = type(name, (cls, SaveError), attrs)
    return _AGREED[cls](message, {r: f"{n}: {m}" for r, (n, m) in failures.items()})


def _error_class(name: str) -> type | None:
    """The ucp_zarr error class of that name (defined here or elsewhere, such as
    ``RuleError``), or None."""
    todo = [CheckpointError]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name and not cls.__name__.startswith("Agreed"):
            return cls
        todo += cls.__subclasses__()
    return None
