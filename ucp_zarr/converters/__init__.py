"""Converters: other systems' checkpoints in (:func:`convert`) and out (:func:`export`).

One module per foreign format. An importer turns a foreign checkpoint into
:class:`~.base.Imported` (lazy tensor sources + JSON values) without reading tensor data;
:func:`~ucp_zarr.protocol.writer.write_checkpoint` then streams it shard by shard into a new
checkpoint, as one transaction. An exporter streams a checkpoint out tensor block by
tensor block into a temporary folder renamed into place at the end. Neither holds a whole
model in memory nor leaves a complete-looking output behind when interrupted.

=================  ===============================  ===================================
format             in (``source=``)                 out (``to=``)
=================  ===============================  ===================================
``deepspeed``      a ZeRO-1/2/3 checkpoint folder   --
``ds-universal``   ``ds_to_universal`` output       a folder ``load_universal`` reads
``dcp``            any ``dcp.save`` folder          a folder ``dcp.load`` reads
``safetensors``    one file, or shards + index      every tensor: one file (``*.safetensors``),
                                                    or shards + index (``model.safetensors``)
``hf``             --                               a folder ``from_pretrained`` loads
``torch``          a ``torch.save`` state dict      --
=================  ===============================  ===================================
"""

from __future__ import annotations

import importlib
import inspect
import os
import threading
from pathlib import Path
from typing import Any, Callable

from ..protocol.reader import open_reader
from ..errors import ConversionError, Keyword
from ..format.safe_paths import check_no_links_under
from ..protocol.saver import SaveOptions, SaveResult
from ..protocol.saving import save_workers
from ..io.factory import open_store
from ..protocol.writer import CONVERT_SHARD_BYTES, total_bytes, write_checkpoint
from .base import Imported

SOURCES = {"deepspeed": "deepspeed", "ds-universal": "ds_universal", "dcp": "dcp", "safetensors": "safetensors",
           "torch": "torch_file"}
"""``source=`` -> the module (in this package) whose ``read`` imports it."""
TARGETS = {"hf": "hf", "safetensors": "safetensors", "dcp": "dcp", "ds-universal": "ds_universal"}
"""``to=`` -> the module whose ``write`` exports to it."""


def detect(src: str | os.PathLike[str]) -> str:
    """The kind of the foreign checkpoint at ``src`` (see :data:`SOURCES`)."""
    p = Path(src)
    if p.is_file():
        if p.name.endswith((".safetensors", ".safetensors.index.json")):
            return "safetensors"
        if p.suffix in (".pt", ".pth", ".bin", ".ckpt"):
            return "torch"
    elif p.is_dir():
        if (p / ".metadata").is_file():
            return "dcp"
        if (p / "latest_universal").is_file() or ((p / "zero").is_dir() and any(p.glob("*model_states.pt"))):
            return "ds-universal"
        if (p / "latest").is_file() or any(p.glob("*model_states.pt")):
            return "deepspeed"
        if any(p.glob("*.safetensors")) or any(p.glob("*.safetensors.index.json")):
            return "safetensors"
    elif not p.exists():
        raise ConversionError(f"{src}: no such file or folder")
    raise ConversionError(f"{src}: not a checkpoint kind ucp_zarr recognises; say which with ", Keyword("source"),
                          f" (one of {sorted(SOURCES)})")


def read_source(src: str | os.PathLike[str], source: str | None = None, **options: Any) -> Imported:
    """Import ``src`` (of kind ``source``, detected when None) without reading tensor data."""
    kind = source or detect(src)
    if kind not in SOURCES:
        raise ConversionError(f"unknown source kind {kind!r} (known: {sorted(SOURCES)})")
    module = importlib.import_module(f".{SOURCES[kind]}", __name__)
    # (trust widens what is unpickled: a source that is never unpickled needs none)
    return module.read(Path(src), **_taken(module.read, f"a {kind} source", options, harmless=("trust",)))


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source: str | None = None,
    rules: Any = None,
    trust: bool = False,
    prefix: str = "",
    overwrite: bool = False,
    max_workers: int | None = None,
    shard_bytes: int = CONVERT_SHARD_BYTES,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SaveResult:
    """Convert the checkpoint at ``src`` (of kind ``source``, see :data:`SOURCES`;
    detected when None) into a ucp_zarr checkpoint at ``dst``.

    ``trust`` allows full unpickling of pickle-based sources that need it (it runs code
    from the file); without it such a file raises
    :class:`~ucp_zarr.errors.UntrustedInputError` naming it. ``prefix`` is prepended to
    the keys of flat sources (``"model."`` makes a safetensors file loadable into
    ``{"model": model.state_dict()}``). ``rules`` (a :class:`~ucp_zarr.Rules`) describe
    tensor-parallel sources that carry no layout of their own. ``max_workers`` as in
    :func:`ucp_zarr.save` (unset: 4, with as many writers as an object store keeps requests
    in flight). ``progress(done, total)`` is called with bytes as shards are read."""
    imported = read_source(src, source, rules=rules, trust=trust, prefix=prefix)
    store = open_store(dst, storage_options)
    options = SaveOptions(shard_bytes=shard_bytes, **save_workers(store, max_workers), overwrite=overwrite)
    if store.local_path is not None:
        check_no_links_under(Path(store.local_path), f"converting {src}")
    return write_checkpoint(
        store, imported.tensors, imported.values, options=options,
        layout=imported.layout, progress=_running_total(progress, total_bytes(imported.tensors)), ties=imported.ties,
        structure=imported.structure,
    )


def export(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    **options: Any,
) -> Path:
    """Export the ucp_zarr checkpoint at ``src`` to ``dst`` in format ``to`` (see
    :data:`TARGETS`); format options pass through:

    * ``hf``: a folder ``from_pretrained`` loads (:mod:`.hf`): the model's weights under its
      own names, ties once; ``prefix`` (default: detected), ``dtype`` (``"bf16"``,
      ``"fp16"``, ``"fp32"``; default: as stored), ``masters`` (the fp32 masters),
      ``max_shard_size`` (default ``"5GB"``), ``names`` (a dict, a callable, or
      ``"megatron_to_llama"``: Hugging Face names, fused tensors split). Files already in
      the folder (``config.json``, the tokenizer) are kept;
    * ``safetensors``: every tensor under its key, into one file when ``dst`` ends in
      ``.safetensors``, else a folder (``max_shard_bytes``, ``keys``);
    * ``dcp``: ``block_bytes``, ``keys``; ``ds-universal``: ``tag``, ``ep_size`` (``1``: needed
      for MoE experts, which ``load_universal`` finds by local index)."""
    if to not in TARGETS:
        raise ConversionError(f"unknown export format {to!r} (known: {sorted(TARGETS)})")
    ck = open_reader(src, storage_options=storage_options)
    if ck.store.local_path is not None:
        _check_apart(Path(ck.store.local_path), Path(dst), replaces=to != "hf")
    module = importlib.import_module(f".{TARGETS[to]}", __name__)
    options = _taken(module.write, f"an export to {to}", options)
    return module.write(ck, Path(dst), overwrite=overwrite, progress=_running_total(progress, ck.nbytes()), **options)


def _check_apart(src: Path, dst: Path, replaces: bool) -> None:
    """Refuse an export into its own checkpoint, or (where the export ``replaces`` the
    folder whole: every format but ``hf``, which keeps what it does not write) into a
    folder that holds it."""
    a, b = src.resolve(), dst.resolve()
    if a == b or b.is_relative_to(a) or (replaces and a.is_relative_to(b)):
        where = "is" if a == b else ("holds" if a.is_relative_to(b) else "is inside")
        raise ConversionError(f"{dst} {where} the checkpoint {src} being exported: export to a folder apart from it")


def _taken(fn: Callable[..., Any], what: str, options: dict[str, Any], harmless: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``options`` that ``fn`` takes; :class:`ConversionError` naming any other that is
    set (not None, empty or False) and not ``harmless``: an option given is never silently
    ignored."""
    params = inspect.signature(fn).parameters
    ignored = sorted(k for k, v in options.items()
                     if k not in params and k not in harmless and v is not None and v is not False and v != "")
    if ignored:
        takes = sorted(k for k, p in params.items() if p.kind is p.KEYWORD_ONLY and k not in ("overwrite", "progress"))
        raise ConversionError(f"{what} takes no option ", *_listed(ignored), " (it takes: ", *(_listed(takes) or ["none"]),
                              ")")
    return {k: v for k, v in options.items() if k in params}


def _listed(names: list[str]) -> list[Any]:
    """``names`` as message parts: keywords (each face spells them its way), comma-separated."""
    parts: list[Any] = []
    for i, name in enumerate(names):
        parts += [", "] * (i > 0) + [Keyword(name)]
    return parts


def _running_total(progress: Callable[[int, int], None] | None, total: int) -> Callable[[int], None] | None:
    """``progress(done, total)`` fed with byte counts as they come (from several threads)."""
    if progress is None:
        return None
    done = [0]
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            done[0] += n
            progress(done[0], total)

    return report
