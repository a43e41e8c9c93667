"""Opening the store a path or URL names (the one module that knows every backend)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import Keyword, OptionError
from .local import LocalStore
from .store import Store


def open_store(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Store:
    """A store for a local path or ``file://`` URL (always the local store: exclusive
    creation, fsync), an object-store URL (``s3://``, ``gs://``, ``az://``: obstore, see
    :mod:`.obstore`), or any other fsspec URL. ``storage_options`` apply to URLs
    only; given for a local path they are refused, never silently ignored."""
    path = os.fspath(path)
    local = path[len("file://") :] if path.startswith("file://") else path if "://" not in path else None
    if local is None:
        from .obstore import open_url

        return open_url(path, storage_options)
    if storage_options:
        raise OptionError(
            Keyword("storage_options"), f" {sorted(storage_options)} do not apply to the local path {local!r} "
            "(it is written with the local store); drop them",
        )
    return LocalStore(local)
