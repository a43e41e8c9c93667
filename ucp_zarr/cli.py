"""The ``ucp-zarr`` command: ``demo``, ``info PATH``, ``verify PATH [--key-file F]``,
``convert SRC DST [--from KIND]``, ``export SRC DST --to KIND``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .checkpoint import open as open_checkpoint
from .errors import CheckpointError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ucp-zarr", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train on 4 processes (TP2xDP2), save, resume on 3 (FSDP2), compare losses")
    d.add_argument("--steps", type=int, default=20, help="last step (exclusive) of both runs")
    d.add_argument("--save-at", type=int, default=10, help="step at which the 4-process run saves")
    d.add_argument("--dir", default=None, help="keep the checkpoint in a new folder here (default: a temp dir)")
    for name, text in (
        ("info", "print a checkpoint's tensors and metadata"),
        ("verify", "check every document, chunk and array digest (and the signature, with --key-file)"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument("path")
        s.add_argument("--storage-options", type=json.loads, default=None, help="JSON dict for fsspec")
        s.add_argument("--key-file", default=None, help="file holding the HMAC key the checkpoint was signed with")
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
    args = p.parse_args(argv)

    if args.cmd in ("convert", "export"):
        return _convert(args)
    if args.cmd == "demo":
        from .examples.elastic_resume import run

        return 0 if run(args.steps, args.save_at, args.dir) else 1
    key = None
    if args.key_file is not None:
        with open(args.key_file, "rb") as f:
            key = f.read()
    try:
        ck = open_checkpoint(args.path, storage_options=args.storage_options, hmac_key=key)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "info":
        print(ck)
        print(json.dumps({k: v for k, v in ck.metadata.items() if k != "values"}, indent=1))
        return 0
    t0 = time.perf_counter()
    try:
        n = ck.verify()
    except CheckpointError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    signed = "signature verified" if key is not None else ("signed, key not given" if ck.meta.authenticated else "unsigned")
    print(f"ok: {len(ck)} tensors, {n} bytes checked in {time.perf_counter() - t0:.2f} s ({signed})")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .convert import convert, export

    bar = _Progress()
    t0 = time.perf_counter()
    try:
        if args.cmd == "convert":
            convert(args.src, args.dst, source=args.source, trust=args.trust, prefix=args.prefix,
                    overwrite=args.overwrite, max_workers=args.workers, progress=bar)
        else:
            export(args.src, args.dst, to=args.to, overwrite=args.overwrite, progress=bar)
    except CheckpointError as e:
        bar.end()
        print(f"error: {e}", file=sys.stderr)
        return 2
    bar.end()
    print(f"{args.cmd}ed {args.src} -> {args.dst} in {time.perf_counter() - t0:.1f} s")
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
