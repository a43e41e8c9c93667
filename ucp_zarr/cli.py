"""The ``ucp-zarr`` command: look into, check and compare checkpoints; convert and export them.

The read-only commands (info, ls, show, stats, verify, diff) never import torch, so they
start in a fraction of a second; each takes ``--json`` for scripts. Errors end the command
with a one-line ``error: ...`` on stderr and a non-zero exit status; a keyword argument an
error names as the fix is spelled as this command's option (``--overwrite``, not
``overwrite=True``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any, Callable

from .protocol.reader import human_bytes
from .errors import (
    CheckpointError,
    CheckpointReplacedError,
    FormatError,
    IncompleteCheckpointError,
    Keyword,
    NotACheckpointError,
    OptionError,
    did_you_mean,
    render,
)
from .cli_output import UsageError, emit, format_num, format_table, open_checkpoint, printable, progress_bar

if TYPE_CHECKING:
    from .browse.checkpoint import Checkpoint
    from .io.store import Store

EXAMPLES = """\
examples:
  ucp-zarr info ckpt/step_100                    facts, layout and the tensor tree
  ucp-zarr ls ckpt/step_100 'model.layers.*'     tensors (glob or key prefix), shapes, sizes
  ucp-zarr ls ckpt/                              the steps under a checkpoint manager's root
  ucp-zarr show ckpt/step_100 model.weight '3:5, 0:4'
  ucp-zarr stats ckpt/step_100 'optim.state.*.exp_avg_sq'
  ucp-zarr verify s3://bucket/ckpt --storage-options '{"anon": false}'
  ucp-zarr diff ckpt/step_100 ckpt/step_200 --json
  ucp-zarr convert ds_ckpt/global_step10 ckpt/converted
  ucp-zarr export ckpt/step_100 model.safetensors --to safetensors

exit status: 0 on success, 1 when verify finds damage or diff finds differences, 2 on errors.
"""

SHOW_LIMIT = 1_000_000
"""The most elements ``show`` reads unless ``--limit`` says otherwise."""
FIND_DEPTH = 3
"""How many folder levels below a path ``info``/``ls`` look for checkpoints when the path is none."""
KEYWORD_OPTIONS = {"hmac_key": "key_file", "to": "target", "max_shard_bytes": "max_shard_size"}
"""Keyword arguments of the Python API whose option here has another ``dest``."""


# --- parser ---------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An argument parser whose epilog may be made when help is shown (``epilog_of``), so
    that ``export --help`` lists the formats from the code without importing it (and torch)
    for the other commands; ``commands`` holds the subcommands' parsers by name."""

    def __init__(self, *args: Any, epilog_of: Callable[[], str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epilog_of = epilog_of
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def format_help(self) -> str:
        if self.epilog_of is not None:
            self.epilog = self.epilog_of()
        return super().format_help()


def build_parser() -> _Parser:
    p = _Parser(
        prog="ucp-zarr", description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--traceback", action="store_true", help="show the full traceback of an error (for bug reports)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, text: str, **kwargs: Any) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=text, description=text, formatter_class=argparse.RawDescriptionHelpFormatter,
                           **kwargs)
        p.commands[name] = s
        return s

    def progress(s: argparse.ArgumentParser) -> None:
        s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar on stderr (default: only when stderr is a terminal)")

    def reader(name: str, text: str, *, bar: bool = False) -> argparse.ArgumentParser:
        s = command(name, text)
        s.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
        s.add_argument("--storage-options", type=_json_dict, default=None, metavar="JSON",
                       help="fsspec options for remote paths, as a JSON object")
        s.add_argument("--key-file", default=None, metavar="FILE",
                       help="file holding the HMAC key the checkpoint was signed with (checks signatures and chunks)")
        if bar:
            progress(s)
        return s

    where = "checkpoint folder or fsspec URL"
    s = reader("info", "print a checkpoint's facts, saving layout and tensors (of a folder of checkpoints: "
                       "the checkpoints in it)")
    s.add_argument("path", help=where + ", or a folder of checkpoints")
    s.add_argument("--lines", type=int, default=200, help="most lines of the tensor tree (default 200)")
    s.add_argument("--all", action="store_true", help="the whole tensor tree")
    s = reader("ls", "list a checkpoint's tensors (of a folder of checkpoints: the checkpoints in it)")
    s.add_argument("path", help=where + ", or a folder of checkpoints")
    s.add_argument("pattern", nargs="?", default=None,
                   help="glob over keys ('model.*'), or a key with what is under it ('model.layers.0')")
    s = reader("show", "print values of a tensor (a slice of it)")
    s.add_argument("path", help=where)
    s.add_argument("key", help="the tensor's key, e.g. model.layers.0.weight")
    s.add_argument("slice", nargs="?", default="", help="numpy-style selection, e.g. '3:5, 0:4', '-1', '-3:', ':, ::2'")
    # a selection may start with '-' ('-3:', '-1, 0'): argument, not option (argparse itself
    # only lets plain negative numbers through)
    s._negative_number_matcher = re.compile(r"^-\d")
    s.add_argument("--rank", type=int, default=None, help="the saving rank's copy of per-rank state (default: the lowest)")
    s.add_argument("--limit", type=int, default=SHOW_LIMIT, help=f"most elements read (default {SHOW_LIMIT:,})")
    s.add_argument("--full", action="store_true", help="print every value (default: numpy's summary with '...')")
    s = reader("stats", "min, max, mean, std, L2 norm and NaN/Inf counts, chunk by chunk", bar=True)
    s.add_argument("path", help=where)
    s.add_argument("keys", nargs="+", metavar="KEY", help="keys, key prefixes or globs ('optim.*.exp_avg')")
    s.add_argument("--rank", type=int, default=None, help="the saving rank's copy of per-rank state (default: the lowest)")
    s = reader("verify", "check every document, chunk and array digest (and the signature, with --key-file)", bar=True)
    s.add_argument("path", help=where)
    s = reader("diff", "compare two checkpoints tensor by tensor (bit-exact) and value by value", bar=True)
    s.add_argument("a", help="the first checkpoint (folder or fsspec URL)")
    s.add_argument("b", help="the second checkpoint")
    s.add_argument("--keys", action="append", default=None, metavar="PATTERN",
                   help="compare only these keys, prefixes or globs (repeatable)")
    s.add_argument("--all", action="store_true", help="list equal tensors too")

    d = command("demo", "train on 4 processes (TP2xDP2), save, resume on 3 (FSDP2), compare losses")
    d.add_argument("--steps", type=int, default=20, help="last step (exclusive) of both runs (default 20)")
    d.add_argument("--save-at", type=int, default=10, help="step at which the 4-process run saves (default 10)")
    d.add_argument("--dir", default=None, help="keep the checkpoint in a new folder here (default: a temp dir)")
    c = command("convert", "convert another system's checkpoint into a ucp_zarr checkpoint",
                epilog_of=lambda: _kinds("source kinds (--from)", "SOURCES"))
    c.add_argument("src", help="the checkpoint to convert (a file or folder; its kind is detected)")
    c.add_argument("dst", help="the new ucp_zarr checkpoint (a folder)")
    c.add_argument("--from", dest="source", default=None, metavar="KIND",
                   help="the source's kind, when detection cannot tell (see below)")
    c.add_argument("--trust", action="store_true",
                   help="allow full unpickling of pickle-based files (runs code from them): only for files you trust")
    c.add_argument("--prefix", default="", help="prepended to the keys of flat sources (e.g. 'model.')")
    c.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    c.add_argument("--workers", dest="max_workers", type=int, default=None, metavar="N",
                   help="threads reading and writing shards (default 4; on an object store, as many writers as it "
                        "keeps requests in flight)")
    c.add_argument("--storage-options", type=_json_dict, default=None, metavar="JSON",
                   help="fsspec options for a remote DST, as a JSON object")
    progress(c)
    e = command("export", "export a ucp_zarr checkpoint into another format",
                epilog_of=lambda: _kinds("formats (--to)", "TARGETS"))
    e.add_argument("src", help="the ucp_zarr checkpoint (folder or fsspec URL)")
    e.add_argument("dst", help="the folder to write (made complete or not at all)")
    e.add_argument("--to", dest="target", required=True, metavar="FORMAT", help="the format to write (see below)")
    e.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    e.add_argument("--keys", action="append", default=None, metavar="KEY",
                   help="dcp and safetensors: export only this tensor or value (repeat the option for more; "
                        "per-rank state can only be left out)")
    e.add_argument("--storage-options", type=_json_dict, default=None, metavar="JSON",
                   help="fsspec options for a remote SRC, as a JSON object")
    h = e.add_argument_group("hf (a folder for from_pretrained; its other files, such as config.json, are kept); "
                             "--max-shard-size also for safetensors, the others for hf only")
    h.add_argument("--prefix", default=None, help="the training prefix of the weights, removed (default: detected)")
    h.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help="cast floating weights")
    h.add_argument("--masters", action="store_true", help="write the fp32 masters where the checkpoint holds them")
    h.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="the largest shard (default: hf 5GB, safetensors 4GiB)")
    h.add_argument("--names", default=None, metavar="MAPPING",
                   help="Hugging Face names for the weights, fused ones split: megatron_to_llama")
    u = e.add_argument_group("ds-universal (a folder DeepSpeed's load_universal reads)")
    u.add_argument("--ep-size", type=int, default=None, metavar="N",
                   help="the expert-parallel size of the loading engines: 1 (needed for a checkpoint with MoE experts)")
    progress(e)
    return p


def _kinds(title: str, table: str) -> str:
    """The kinds of a table of :mod:`ucp_zarr.converters` (``SOURCES``, ``TARGETS``), each with
    the first sentence of its module's docstring (read from the source, not imported)."""
    convert = importlib.import_module(".converters", __package__)
    lines = [f"{title}:"]
    for kind, module in getattr(convert, table).items():
        name = f"{convert.__name__}.{module}"
        spec = importlib.util.find_spec(name)
        source = spec.loader.get_source(name) if spec is not None and spec.loader is not None else None
        doc = " ".join((ast.get_docstring(ast.parse(source or "")) or "").split()).replace("``", "")
        lines.append(textwrap.fill(doc.split(". ")[0].rstrip("."), 100, initial_indent=f"  {kind:<14}",
                                   subsequent_indent=" " * 16))
    return "\n".join(lines)


def _json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.cmd == "show" and not args.slice and len(extra) == 1 and not extra[0].startswith("--"):
        # argparse (< 3.12) gives an optional positional its value before any option:
        # 'show PATH KEY --rank 1 3:5' leaves the selection over
        args.slice, extra = extra[0], []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return COMMANDS[args.cmd](args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`ucp-zarr ls ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the final flush must not fail again)
        return 141
    except Exception as e:  # every failure is one line (--traceback for the whole story)
        if args.traceback:
            raise
        print(f"error: {_reason(e, _spelling(parser.commands[args.cmd]))}", file=sys.stderr)
        return 2


def _reason(e: BaseException, spell: Callable[[Keyword], str]) -> str:
    if isinstance(e, CheckpointError):
        return render(e, spell)
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    if isinstance(e, (UsageError, ValueError, IndexError)):
        return str(e)
    if isinstance(e, FileNotFoundError):
        return f"no such file or folder: {e.filename or e}"
    return f"{type(e).__name__}: {e}"


def _spelling(parser: argparse.ArgumentParser) -> Callable[[Keyword], str]:
    """How a command spells a keyword argument of the Python API that an error names: as its
    option (``overwrite=True`` -> ``--overwrite``, ``source`` -> ``--from``), or, where it has
    none, as Python does, saying so."""
    options = {a.dest: a for a in parser._actions if a.option_strings}

    def spell(kw: Keyword) -> str:
        action = options.get(KEYWORD_OPTIONS.get(kw.name, kw.name))
        if action is None:
            return f"{kw} (in Python: `{parser.prog}` has no option for it)"
        flag = max(action.option_strings, key=len)
        return flag if action.nargs == 0 or kw.value is ... else f"{flag} {kw.value}"

    return spell


# --- read-only commands -----------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from .browse.inspect import checkpoint_info

    try:
        ck = open_checkpoint(args.path, args)
    except (NotACheckpointError, IncompleteCheckpointError) as e:
        return _folder(args, e)
    info = checkpoint_info(ck)
    if args.json:
        emit(info)
        return 0
    tree = repr(ck).splitlines()
    if len(tree) > args.lines and not args.all:
        tree = tree[: args.lines] + [f"  ... {len(tree) - args.lines} more lines (--all, or ucp-zarr ls PATH)"]
    print("\n".join(tree))
    facts = {k: info[k] for k in ("created", "library", "world_size", "authenticated")}
    print("facts: " + json.dumps(facts))
    print("layout: " + json.dumps(info["layout"], default=str))
    if info["values"]:
        print("values: " + _clip(json.dumps(info["values"], default=str), 2000))
    if info["rank_values"]:
        print(f"per-rank values: {printable(', '.join(sorted(info['rank_values'])))}")
    return 0


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 20] + f" ... ({len(text):,} chars)"


def cmd_ls(args: argparse.Namespace) -> int:
    from .browse.inspect import list_tensors

    try:
        ck = open_checkpoint(args.path, args)
    except (NotACheckpointError, IncompleteCheckpointError) as e:
        return _folder(args, e)
    rows = list_tensors(ck, args.pattern)
    if args.pattern is not None and not rows:
        raise UsageError(f"no tensor of {ck.store.url} matches {args.pattern!r}")
    if args.json:
        emit([r.to_dict() for r in rows])
        return 0
    table = [
        [r.key, "x".join(map(str, r.shape)) or "()", r.dtype, human_bytes(r.nbytes), "x".join(map(str, r.chunks)) or "()",
         str(r.shards) + (f" x {len(r.ranks)} ranks" if r.ranks else "")]
        for r in rows
    ]
    print(format_table(["key", "shape", "dtype", "size", "chunks", "shards"], table, right={3}))
    print(f"{len(rows)} tensors, {human_bytes(sum(r.nbytes for r in rows))}")
    return 0


# --- a folder that is no checkpoint ---------------------------------------------------------------


def _folder(args: argparse.Namespace, why: CheckpointError) -> int:
    """``info``/``ls`` of a path that is no (complete) checkpoint: the steps of a checkpoint
    manager's root, or the checkpoints below it, or, for another system's checkpoint, what it
    is and how to convert it; else ``why``."""
    from .ops import list_steps
    from .io.factory import open_store
    from .protocol.liveness import MARKER, REPLACE_RECORD

    store = open_store(args.path, args.storage_options)
    if store.exists(MARKER) or store.exists(REPLACE_RECORD):  # itself a save that did not finish
        raise why
    steps = list_steps(args.path, storage_options=args.storage_options)
    if steps:
        return _steps_table(args, steps)
    found = _checkpoints_under(store, args.storage_options)
    if found:
        return _found_table(args, store, found)
    kind = _foreign_kind(args.path)
    if kind is not None:
        raise UsageError(
            f"{args.path} holds a checkpoint of kind {kind!r}, not a ucp_zarr checkpoint: convert it with "
            f"`ucp-zarr convert {args.path} DST` (see ucp-zarr convert --help)"
        )
    raise why


def _steps_table(args: argparse.Namespace, steps: list[Any]) -> int:
    """The steps a checkpoint manager keeps under its root."""
    if args.json:
        emit([dataclasses.asdict(s) for s in steps])
        return 0
    rows = [
        [str(s.step), s.state, "-" if s.nbytes is None else human_bytes(s.nbytes), format_num(s.tensors), format_num(s.world_size),
         ",".join(s.layout) or "-", s.created or "-", s.path]
        for s in steps
    ]
    print(format_table(["step", "state", "size", "tensors", "ranks", "layout", "created", "path"], rows, right={0, 2, 3, 4}))
    print(f"{len(steps)} steps, {sum(s.committed for s in steps)} committed")
    return 0


def _checkpoints_under(store: "Store", storage_options: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The checkpoints in the folders below ``store`` (at most ``FIND_DEPTH`` levels, hidden
    ones skipped, none inside another): (relative path, :class:`Checkpoint` or the
    :class:`IncompleteCheckpointError` of one that was never committed), by path."""
    from .browse.checkpoint import open_store_checkpoint
    from .format.documents import METADATA_FILE
    from .io.factory import open_store
    from .protocol.liveness import MARKER

    folders = {k.rpartition("/")[0] for k in store.list() if k.rpartition("/")[2] in (METADATA_FILE, MARKER)}
    found: list[tuple[str, Any]] = []
    for rel in sorted(folders - {""}, key=lambda f: (f.count("/"), f)):
        parts = rel.split("/")
        if len(parts) > FIND_DEPTH or any(p.startswith(".") for p in parts):
            continue
        if any(rel.startswith(f + "/") for f, _ in found):
            continue
        try:
            found.append((rel, open_store_checkpoint(open_store(f"{store.url.rstrip('/')}/{rel}", storage_options))))
        except IncompleteCheckpointError as e:
            found.append((rel, e))
        except (FormatError, NotACheckpointError):
            continue  # a Zarr group of something else: there may be checkpoints inside it
    return sorted(found, key=lambda f: f[0])


def _found_table(args: argparse.Namespace, store: "Store", found: list[tuple[str, Any]]) -> int:
    rows = []
    for rel, ck in found:
        if isinstance(ck, CheckpointError):
            rows.append({"path": rel, "state": "incomplete", "error": str(ck)})
        else:
            rows.append({"path": rel, "state": "committed", "step": ck.metadata["step"], "nbytes": ck.nbytes(),
                         "tensors": len(ck), "world_size": ck.meta.world_size, "created": ck.meta.created})
    if args.json:
        emit(rows)
        return 0
    print(format_table(
        ["path", "state", "step", "size", "tensors", "ranks", "created"],
        [[r["path"], r["state"], format_num(r.get("step")), "-" if "nbytes" not in r else human_bytes(r["nbytes"]),
          format_num(r.get("tensors")), format_num(r.get("world_size")), r.get("created") or "-"] for r in rows],
        right={2, 3, 4, 5},
    ))
    committed = sum(r["state"] == "committed" for r in rows)
    print(f"{len(rows)} checkpoints in {store.url} ({committed} committed): ucp-zarr info {store.url}/PATH for one")
    return 0


def _foreign_kind(path: str) -> str | None:
    """The kind of another system's checkpoint at the local ``path`` (``ucp-zarr convert
    --from``), or None."""
    if "://" in path and not path.startswith("file://"):
        return None
    from .converters import detect
    from .errors import ConversionError

    try:
        return detect(path.removeprefix("file://"))
    except ConversionError:
        return None


def cmd_show(args: argparse.Namespace) -> int:
    import numpy as np

    from .format.dtypes import stored_dtype_by_name
    from .browse.values import format_index, parse_index, selection_shape, widen

    ck = open_checkpoint(args.path, args)
    entry = ck._entry(args.key)  # (an unknown key: the checkpoint's error, with close keys)
    index = parse_index(args.slice)
    try:
        shape = selection_shape(tuple(entry.shape), index)
    except IndexError as e:
        raise UsageError(f"tensor {args.key!r} of shape {list(entry.shape)}: {e}") from None
    n = math.prod(shape)
    if n > args.limit:
        raise UsageError(
            f"{args.key}[{format_index(index)}] selects {n:,} elements, more than --limit {args.limit:,}: "
            "narrow the selection (e.g. '0:4, 0:8') or raise --limit"
        )
    values = widen(ck.select_numpy(args.key, index, args.rank), entry.dtype)
    where = f"{args.key}[{format_index(index)}]" if index else args.key
    if args.json:
        emit({"key": args.key, "index": format_index(index), "shape": list(shape), "dtype": entry.dtype,
               "values": _json_values(values.tolist())})
        return 0
    shown = f" (shown as {values.dtype})" if stored_dtype_by_name(entry.dtype).bits else ""
    print(f"{printable(where)}: shape {list(shape)}, {entry.dtype}{shown}")
    # every float as the shortest text that reads back as it (numpy's default rounds to 8 digits)
    with np.printoptions(threshold=sys.maxsize if args.full else 1000, linewidth=_width(), floatmode="unique"):
        print(np.array2string(values, separator=", ") if values.ndim else repr(values.item()))
    return 0


def _width() -> int:
    try:
        return max(os.get_terminal_size(sys.stdout.fileno()).columns, 60)
    except OSError:
        return 120


def _json_values(x: Any) -> Any:
    """Nested lists of numbers for strict JSON (non-finite floats spelled as strings, complex
    numbers as [real, imag])."""
    if isinstance(x, list):
        return [_json_values(v) for v in x]
    if isinstance(x, complex):
        return [_json_values(x.real), _json_values(x.imag)]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def _selected(ck: "Checkpoint", patterns: list[str]) -> list[str]:
    from .browse.inspect import select_keys

    keys: list[str] = []
    for p in patterns:
        got = select_keys(ck, [p]) or select_keys(ck, [p], ties=True)  # (an alias of a tied tensor, asked for)
        if not got:
            raise UsageError(f"no tensor of {ck.store.url} matches {p!r}" + did_you_mean(p, ck.keys()))
        keys += [k for k in got if k not in keys]
    return keys


def cmd_stats(args: argparse.Namespace) -> int:
    from .browse.inspect import stats_of

    ck = open_checkpoint(args.path, args)
    keys = _selected(ck, args.keys)
    with progress_bar(args, "stats") as bar:
        out = stats_of(ck, keys, rank=args.rank, progress=bar)
    if args.json:
        emit([s.to_dict() for s in out])
        return 0
    rows = [[s.key, s.dtype, "x".join(map(str, s.shape)) or "()", format_num(s.min), format_num(s.max), format_num(s.mean), format_num(s.std),
             format_num(s.norm), str(s.nan), str(s.inf)] for s in out]
    print(format_table(["key", "dtype", "shape", "min", "max", "mean", "std", "norm", "nan", "inf"], rows,
                 right=set(range(3, 10))))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    url = args.path
    try:
        ck = open_checkpoint(args.path, args)  # (a damaged commit record is damage too: exit 1)
        url = ck.store.url
        with progress_bar(args, "verify") as bar:
            n = ck.verify(progress=bar)
    except (NotACheckpointError, IncompleteCheckpointError, OptionError, CheckpointReplacedError):  # (none, or
        # bad options, or replaced while checked: 2)
        raise
    except CheckpointError as e:
        if args.json:
            emit({"ok": False, "url": url, "error": str(e)})
        print(f"error: verify FAILED: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    signed = "signature verified" if args.key_file is not None else (
        "signed, key not given" if ck.meta.authenticated else "unsigned")
    if args.json:
        emit({"ok": True, "url": ck.store.url, "tensors": len(ck), "bytes": n, "seconds": round(seconds, 3),
               "signature": signed})
    else:
        print(f"ok: {len(ck)} tensors, {n} bytes checked in {seconds:.2f} s ({signed})")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from .browse.diff import diff
    from .browse.inspect import select_keys

    a, b = open_checkpoint(args.a, args, others=(args.b,)), open_checkpoint(args.b, args, others=(args.a,))
    if args.keys is not None:
        for p in args.keys:
            if not select_keys(a, [p], ties=True) and not select_keys(b, [p], ties=True):
                raise UsageError(f"no tensor of either checkpoint matches {p!r}")
    with progress_bar(args, "diff") as bar:
        result = diff(a, b, keys=args.keys, progress=bar)
    if args.json:
        emit(result.to_dict())
        return 0 if result.equal else 1
    rows = [
        [r.key + ("" if r.rank is None else f" (rank {r.rank})"), r.status,
         _spell(r.shape_a, r.dtype_a), _spell(r.shape_b, r.dtype_b), format_num(r.ndiff), format_num(r.max_abs), format_num(r.max_rel),
         format_num(r.nan_mismatch)]
        for r in result.rows if args.all or r.status != "equal"
    ]
    if rows:
        print(format_table(["key", "status", "a", "b", "ndiff", "max_abs", "max_rel", "nan_mismatch"], rows,
                     right={4, 5, 6, 7}))
    for v in result.values:
        print(f"value {printable(v.key)}: {v.status}: {_clip(json.dumps(v.a), 200)} -> {_clip(json.dumps(v.b), 200)}")
    counts = ", ".join(f"{n} {s}" for s, n in result.counts().items() if n) or "no tensors"
    verdict = "identical" if result.equal else "different"
    print(f"{verdict}: {counts}; {len(result.values)} value(s) differ")
    return 0 if result.equal else 1


def _spell(shape: tuple[int, ...] | None, dtype: str | None) -> str:
    return "-" if shape is None else f"{'x'.join(map(str, shape)) or '()'} {dtype}"


# --- commands that write ----------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from .examples.elastic_resume import run

    return 0 if run(args.steps, args.save_at, args.dir) else 1


def cmd_convert(args: argparse.Namespace) -> int:
    from .converters import convert, export

    t0 = time.perf_counter()
    with progress_bar(args, args.cmd) as bar:
        if args.cmd == "convert":
            convert(args.src, args.dst, source=args.source, trust=args.trust, prefix=args.prefix,
                    overwrite=args.overwrite, max_workers=args.max_workers, storage_options=args.storage_options,
                    progress=bar)
        else:
            given = {"prefix": args.prefix, "dtype": args.dtype, "masters": args.masters,
                     "max_shard_size": args.max_shard_size, "names": args.names, "ep_size": args.ep_size,
                     "keys": args.keys}
            if args.target == "safetensors" and args.max_shard_size is not None:  # (its option counts bytes)
                from .converters.hf import shard_size
                given["max_shard_bytes"] = shard_size(given.pop("max_shard_size"))
            # (an option the format does not take is refused by export, never ignored)
            export(args.src, args.dst, to=args.target, overwrite=args.overwrite, progress=bar,
                   storage_options=args.storage_options, **{k: v for k, v in given.items() if v is not None})
    print(f"{args.cmd}ed {args.src} -> {args.dst} in {time.perf_counter() - t0:.1f} s")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "info": cmd_info, "ls": cmd_ls, "show": cmd_show, "stats": cmd_stats, "verify": cmd_verify, "diff": cmd_diff,
    "demo": cmd_demo, "convert": cmd_convert, "export": cmd_convert,
}


if __name__ == "__main__":
    sys.exit(main())
