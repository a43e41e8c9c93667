"""The ``ucp-zarr`` command: look into, check and compare checkpoints; convert and export them.

The read-only commands (info, ls, show, stats, verify, diff) never import torch, so they
start in a fraction of a second; each takes ``--json`` for scripts. Errors end the command
with a one-line ``error: ...`` on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Collection

from .checkpoint import _human
from .errors import CheckpointError, IncompleteCheckpointError, NotACheckpointError

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

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


class UsageError(Exception):
    """Bad input on the command line (a key, a selection): reported as ``error: ...``."""


# --- parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ucp-zarr", description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--traceback", action="store_true", help="show the full traceback of an error (for bug reports)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def reader(name: str, text: str, *, progress: bool = False) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
        s.add_argument("--storage-options", type=_json_dict, default=None, metavar="JSON",
                       help="fsspec options for remote paths, as a JSON object")
        s.add_argument("--key-file", default=None, metavar="FILE",
                       help="file holding the HMAC key the checkpoint was signed with (checks signatures and chunks)")
        if progress:
            s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                           help="progress bar on stderr (default: when stderr is a terminal)")
        return s

    s = reader("info", "print a checkpoint's facts, saving layout and tensors")
    s.add_argument("path", help="checkpoint folder or fsspec URL")
    s.add_argument("--lines", type=int, default=200, help="most lines of the tensor tree (default 200)")
    s.add_argument("--all", action="store_true", help="the whole tensor tree")
    s = reader("ls", "list a checkpoint's tensors (or the steps under a checkpoint manager's root)")
    s.add_argument("path", help="checkpoint, or a folder of checkpoints")
    s.add_argument("pattern", nargs="?", default=None,
                   help="glob over keys ('model.*'), or a key with what is under it ('model.layers.0')")
    s = reader("show", "print values of a tensor (a slice of it)")
    s.add_argument("path")
    s.add_argument("key", help="the tensor's key, e.g. model.layers.0.weight")
    s.add_argument("slice", nargs="?", default="", help="numpy-style selection, e.g. '3:5, 0:4', '-1', '-3:', ':, ::2'")
    # a selection may start with '-' ('-3:', '-1, 0'): argument, not option (argparse itself
    # only lets plain negative numbers through)
    s._negative_number_matcher = re.compile(r"^-\d")
    s.add_argument("--rank", type=int, default=None, help="the saving rank's copy of per-rank state (default: the lowest)")
    s.add_argument("--limit", type=int, default=SHOW_LIMIT, help=f"most elements read (default {SHOW_LIMIT:,})")
    s.add_argument("--full", action="store_true", help="print every value (default: numpy's summary with '...')")
    s = reader("stats", "min, max, mean, std, L2 norm and NaN/Inf counts, chunk by chunk", progress=True)
    s.add_argument("path")
    s.add_argument("keys", nargs="+", metavar="KEY", help="keys, key prefixes or globs ('optim.*.exp_avg')")
    s.add_argument("--rank", type=int, default=None, help="the saving rank's copy of per-rank state (default: the lowest)")
    s = reader("verify", "check every document, chunk and array digest (and the signature, with --key-file)",
               progress=True)
    s.add_argument("path")
    s = reader("diff", "compare two checkpoints tensor by tensor (bit-exact) and value by value", progress=True)
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--keys", action="append", default=None, metavar="PATTERN",
                   help="compare only these keys, prefixes or globs (repeatable)")
    s.add_argument("--all", action="store_true", help="list equal tensors too")

    d = sub.add_parser("demo", help="train on 4 processes (TP2xDP2), save, resume on 3 (FSDP2), compare losses")
    d.add_argument("--steps", type=int, default=20, help="last step (exclusive) of both runs")
    d.add_argument("--save-at", type=int, default=10, help="step at which the 4-process run saves")
    d.add_argument("--dir", default=None, help="keep the checkpoint in a new folder here (default: a temp dir)")
    c = sub.add_parser("convert", help="convert another system's checkpoint into a ucp_zarr checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--from", dest="source", default=None, help="source kind (default: detected)")
    c.add_argument("--trust", action="store_true", help="allow full unpickling of pickle-based files (runs their code)")
    c.add_argument("--prefix", default="", help="prepended to the keys of flat sources (e.g. 'model.')")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--workers", type=int, default=4)
    e = sub.add_parser("export", help="export a ucp_zarr checkpoint into another format")
    e.add_argument("src")
    e.add_argument("dst")
    e.add_argument("--to", required=True)
    e.add_argument("--overwrite", action="store_true")
    return p


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
        print(f"error: {_reason(e)}", file=sys.stderr)
        return 2


def _reason(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    if isinstance(e, (CheckpointError, UsageError, ValueError, IndexError)):
        return str(e)
    if isinstance(e, FileNotFoundError):
        return f"no such file or folder: {e.filename or e}"
    return f"{type(e).__name__}: {e}"


# --- shared -------------------------------------------------------------------------------


def _open(path: str, args: argparse.Namespace) -> "Checkpoint":
    from .checkpoint import open as open_checkpoint

    return open_checkpoint(path, storage_options=args.storage_options, hmac_key=_key(args))


def _key(args: argparse.Namespace) -> bytes | None:
    if args.key_file is None:
        return None
    try:
        with open(args.key_file, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"cannot read the key file {args.key_file}: {e.strerror}") from None


def _emit(data: Any) -> None:
    json.dump(data, sys.stdout, default=str, allow_nan=False)
    sys.stdout.write("\n")


def _bar(args: argparse.Namespace) -> "_Progress | None":
    on = args.progress if args.progress is not None else sys.stderr.isatty()
    return _Progress() if on else None


def _table(header: list[str], rows: list[list[str]], right: Collection[int] = ()) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = [(str.rjust if i in right else str.ljust) for i in range(len(header))]
    lines = ["  ".join(f(c, w) for f, c, w in zip(fmt, r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


# --- read-only commands -----------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from .inspect import checkpoint_info

    ck = _open(args.path, args)
    info = checkpoint_info(ck)
    if args.json:
        _emit(info)
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
        print(f"per-rank values: {', '.join(sorted(info['rank_values']))}")
    return 0


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 20] + f" ... ({len(text):,} chars)"


def cmd_ls(args: argparse.Namespace) -> int:
    from .inspect import list_tensors

    try:
        ck = _open(args.path, args)
    except (NotACheckpointError, IncompleteCheckpointError) as e:
        return _ls_steps(args, e)
    rows = list_tensors(ck, args.pattern)
    if args.pattern is not None and not rows:
        raise UsageError(f"no tensor of {ck.store.url} matches {args.pattern!r}")
    if args.json:
        _emit([r.to_dict() for r in rows])
        return 0
    table = [
        [r.key, "x".join(map(str, r.shape)) or "()", r.dtype, _human(r.nbytes), "x".join(map(str, r.chunks)) or "()",
         str(r.shards) + (f" x {len(r.ranks)} ranks" if r.ranks else "")]
        for r in rows
    ]
    print(_table(["key", "shape", "dtype", "size", "chunks", "shards"], table, right={3}))
    print(f"{len(rows)} tensors, {_human(sum(r.nbytes for r in rows))}")
    return 0


def _ls_steps(args: argparse.Namespace, why: CheckpointError) -> int:
    """``ls`` of a folder that is no checkpoint: the steps a checkpoint manager keeps there."""
    try:
        from .ops import list_steps
    except ImportError:
        raise UsageError(f"{why} (and listing a manager's steps needs ucp_zarr.ops, which is not available)") from None
    steps = list_steps(args.path, storage_options=args.storage_options)
    if not steps:
        raise why
    if args.json:
        _emit([dataclasses.asdict(s) for s in steps])
        return 0
    rows = [
        [str(s.step), s.state, "-" if s.nbytes is None else _human(s.nbytes), _num(s.tensors), _num(s.world_size),
         ",".join(s.layout) or "-", s.created or "-", s.path]
        for s in steps
    ]
    print(_table(["step", "state", "size", "tensors", "ranks", "layout", "created", "path"], rows, right={0, 2, 3, 4}))
    print(f"{len(steps)} steps, {sum(s.committed for s in steps)} committed")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    import numpy as np

    from .dtypes import stored_dtype_by_name
    from .inspect import format_index, parse_index, selection_shape, widen

    ck = _open(args.path, args)
    if args.key not in ck:
        raise UsageError(f"no tensor {args.key!r} in {ck.store.url}" + _near(args.key, ck.keys()))
    entry = ck.meta.tensors[args.key]
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
        _emit({"key": args.key, "index": format_index(index), "shape": list(shape), "dtype": entry.dtype,
               "values": _json_values(values.tolist())})
        return 0
    shown = f" (shown as {values.dtype})" if stored_dtype_by_name(entry.dtype).bits else ""
    print(f"{where}: shape {list(shape)}, {entry.dtype}{shown}")
    with np.printoptions(threshold=sys.maxsize if args.full else 1000, linewidth=_width()):
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


def _near(key: str, keys: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, keys, n=3)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def _selected(ck: "Checkpoint", patterns: list[str]) -> list[str]:
    from .inspect import select_keys

    keys: list[str] = []
    for p in patterns:
        got = select_keys(ck, [p])
        if not got:
            raise UsageError(f"no tensor of {ck.store.url} matches {p!r}" + _near(p, ck.keys()))
        keys += [k for k in got if k not in keys]
    return keys


def cmd_stats(args: argparse.Namespace) -> int:
    from .inspect import tensor_stats

    ck = _open(args.path, args)
    keys = _selected(ck, args.keys)
    bar = _bar(args)
    total = sum(ck.meta.tensors[k].nbytes for k in keys)
    done = 0
    out = []
    for k in keys:
        base = done
        out.append(tensor_stats(ck, k, rank=args.rank, progress=None if bar is None else lambda d, _t: bar(base + d, total)))
        done += ck.meta.tensors[k].nbytes
    if bar is not None:
        bar.end()
    if args.json:
        _emit([s.to_dict() for s in out])
        return 0
    rows = [[s.key, s.dtype, "x".join(map(str, s.shape)) or "()", _num(s.min), _num(s.max), _num(s.mean), _num(s.std),
             _num(s.norm), str(s.nan), str(s.inf)] for s in out]
    print(_table(["key", "dtype", "shape", "min", "max", "mean", "std", "norm", "nan", "inf"], rows,
                 right=set(range(3, 10))))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    ck = _open(args.path, args)
    bar = _bar(args)
    t0 = time.perf_counter()
    try:
        n = ck.verify(progress=bar)
    except CheckpointError as e:
        if bar is not None:
            bar.end()
        if args.json:
            _emit({"ok": False, "url": ck.store.url, "error": str(e)})
        print(f"error: verify FAILED: {e}", file=sys.stderr)
        return 1
    if bar is not None:
        bar.end()
    seconds = time.perf_counter() - t0
    signed = "signature verified" if args.key_file is not None else (
        "signed, key not given" if ck.meta.authenticated else "unsigned")
    if args.json:
        _emit({"ok": True, "url": ck.store.url, "tensors": len(ck), "bytes": n, "seconds": round(seconds, 3),
               "signature": signed})
    else:
        print(f"ok: {len(ck)} tensors, {n} bytes checked in {seconds:.2f} s ({signed})")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from .inspect import diff, select_keys

    a, b = _open(args.a, args), _open(args.b, args)
    if args.keys is not None:
        for p in args.keys:
            if not select_keys(a, [p]) and not select_keys(b, [p]):
                raise UsageError(f"no tensor of either checkpoint matches {p!r}")
    bar = _bar(args)
    result = diff(a, b, keys=args.keys, progress=bar)
    if bar is not None:
        bar.end()
    if args.json:
        _emit(result.to_dict())
        return 0 if result.equal else 1
    rows = [
        [r.key + ("" if r.rank is None else f" (rank {r.rank})"), r.status,
         _spell(r.shape_a, r.dtype_a), _spell(r.shape_b, r.dtype_b), _num(r.ndiff), _num(r.max_abs), _num(r.max_rel),
         _num(r.nan_mismatch)]
        for r in result.rows if args.all or r.status != "equal"
    ]
    if rows:
        print(_table(["key", "status", "a", "b", "ndiff", "max_abs", "max_rel", "nan_mismatch"], rows,
                     right={4, 5, 6, 7}))
    for v in result.values:
        print(f"value {v.key}: {v.status}: {_clip(json.dumps(v.a), 200)} -> {_clip(json.dumps(v.b), 200)}")
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
    from .convert import convert, export

    bar = _Progress()
    t0 = time.perf_counter()
    try:
        if args.cmd == "convert":
            convert(args.src, args.dst, source=args.source, trust=args.trust, prefix=args.prefix,
                    overwrite=args.overwrite, max_workers=args.workers, progress=bar)
        else:
            export(args.src, args.dst, to=args.to, overwrite=args.overwrite, progress=bar)
    finally:
        bar.end()
    print(f"{args.cmd}ed {args.src} -> {args.dst} in {time.perf_counter() - t0:.1f} s")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "info": cmd_info, "ls": cmd_ls, "show": cmd_show, "stats": cmd_stats, "verify": cmd_verify, "diff": cmd_diff,
    "demo": cmd_demo, "convert": cmd_convert, "export": cmd_convert,
}


class _Progress:
    """A one-line progress bar on stderr (redrawn at most ten times a second)."""

    def __init__(self) -> None:
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < 0.1 and done < total:
            return
        self.last, self.shown = now, True
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        print(f"\r[{bar:<30}] {frac:6.1%} {done / 2**20:,.0f}/{total / 2**20:,.0f} MiB", end="", file=sys.stderr)

    def end(self) -> None:
        if self.shown:
            print(file=sys.stderr)
            self.shown = False


if __name__ == "__main__":
    sys.exit(main())
