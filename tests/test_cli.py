"""The ``ucp-zarr`` command line: every command in text and JSON, errors, progress, that the
read-only commands never import torch, how fast they start, and bounded memory on a
checkpoint of several GiB."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ucp_zarr
from ucp_zarr.browse import inspect as I
from ucp_zarr.browse import diff as D
from ucp_zarr.cli import COMMANDS, build_parser, main

SMALL = dict(chunk_bytes=1 << 9, shard_bytes=1 << 11)
PY = sys.executable


def _state(step: int = 5) -> dict:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 30, generator=g)
    w[1, 2] = float("nan")
    return {
        "model": {"layers": {"0": {"weight": w, "bias": torch.randn(30, generator=g).bfloat16()},
                             "1": {"weight": torch.arange(12, dtype=torch.int32).reshape(3, 4)}},
                  "scale": torch.tensor(1.5)},
        "optim": {"state": {"model.layers.0.weight": {"exp_avg": torch.zeros(40, 30)}}},
        "step": step,
    }


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("cli")
    out = {"a": base / "a", "b": base / "b", "root": base / "root"}
    ucp_zarr.save(_state(), out["a"], **SMALL)
    s = _state(6)
    s["model"]["layers"]["0"]["weight"][0, 0] += 1.0
    del s["model"]["scale"]
    ucp_zarr.save(s, out["b"], **SMALL)
    from ucp_zarr.ops import step_name

    for step in (100, 200):
        ucp_zarr.save(_state(step), out["root"] / step_name(step))
    return out


def run(capsys, *args: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    got = capsys.readouterr()
    return rc, got.out, got.err


def run_json(capsys, *args: object) -> tuple[int, object]:
    rc, out, err = run(capsys, *args, "--json")
    assert out.count("\n") == 1, "one JSON document on one line"
    return rc, json.loads(out)


# --- commands -----------------------------------------------------------------------------------


def test_help(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for cmd in ("info", "ls", "show", "stats", "verify", "diff", "convert", "export", "demo"):
        assert f"\n    {cmd} " in out, cmd
    assert "examples:" in out and "ucp-zarr show ckpt/step_100 model.weight '3:5, 0:4'" in out and "exit status" in out
    with pytest.raises(SystemExit):
        main(["show", "--help"])
    out = capsys.readouterr().out
    assert "numpy-style selection" in out and "--json" in out and "--storage-options" in out


def test_every_option_has_help() -> None:
    parser = build_parser()
    assert set(parser.commands) == set(COMMANDS)
    for name, sub in parser.commands.items():
        for action in sub._actions:
            assert action.help and action.help.strip(), (name, action.dest)


@pytest.mark.parametrize("cmd, option, table", [("export", "--to", "TARGETS"), ("convert", "--from", "SOURCES")])
def test_help_lists_the_formats_of_the_code(capsys, cmd: str, option: str, table: str) -> None:
    from ucp_zarr import converters
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    out = capsys.readouterr().out
    listed = out.split(f"({option}):\n")[1].splitlines()
    kinds = [line.split()[0] for line in listed if line.startswith("  ") and not line.startswith("   ")]
    assert kinds == list(getattr(converters, table)) and all(len(line) <= 100 for line in listed)


def test_info(capsys, paths) -> None:
    rc, out, err = run(capsys, "info", paths["a"])
    ck = ucp_zarr.open(paths["a"])
    assert rc == 0 and err == ""
    assert out.startswith(repr(ck)) and '"world_size": 1' in out and 'values: {"step": 5}' in out
    rc, short, _ = run(capsys, "info", paths["a"], "--lines", "3")
    tree = repr(ck).splitlines()
    assert rc == 0 and short.splitlines()[:4] == tree[:3] + [f"  ... {len(tree) - 3} more lines (--all, or ucp-zarr ls PATH)"]
    assert run(capsys, "info", paths["a"], "--lines", "3", "--all")[1] == out
    rc, data = run_json(capsys, "info", paths["a"])
    assert rc == 0 and data == json.loads(json.dumps(I.checkpoint_info(ck)))
    assert data["step"] == 5 and data["index"]["model.layers.0.bias"]["dtype"] == "bfloat16"


def test_ls(capsys, paths) -> None:
    rc, out, _ = run(capsys, "ls", paths["a"])
    lines = out.splitlines()
    assert rc == 0 and lines[0].split() == ["key", "shape", "dtype", "size", "chunks", "shards"]
    w = next(line.split() for line in lines if line.startswith("model.layers.0.weight "))
    row = next(r for r in I.list_tensors(ucp_zarr.open(paths["a"])) if r.key == "model.layers.0.weight")
    assert w == ["model.layers.0.weight", "40x30", "float32", "4.7", "KiB", "x".join(map(str, row.chunks)), str(row.shards)]
    assert lines[-1] == f"5 tensors, {ucp_zarr.protocol.reader.human_bytes(ucp_zarr.open(paths['a']).nbytes())}"
    rc, data = run_json(capsys, "ls", paths["a"], "model.layers.*")
    assert rc == 0 and [d["key"] for d in data] == ["model.layers.0.weight", "model.layers.0.bias", "model.layers.1.weight"]
    assert data[1] == next(r for r in I.list_tensors(ucp_zarr.open(paths["a"])) if r.key == "model.layers.0.bias").to_dict()
    rc, out, _ = run(capsys, "ls", paths["a"], "model.layers.1")  # a plain name: its subtree
    assert rc == 0 and "model.layers.1.weight" in out and "model.layers.0" not in out
    rc, out, err = run(capsys, "ls", paths["a"], "nothing*")
    assert rc == 2 and out == "" and err == f"error: no tensor of {paths['a']} matches 'nothing*'\n"


def test_ls_manager_root(capsys, paths) -> None:
    rc, out, err = run(capsys, "ls", paths["root"])
    lines = out.splitlines()
    assert rc == 0 and err == "" and lines[0].split() == ["step", "state", "size", "tensors", "ranks", "layout", "created", "path"]
    assert [line.split()[:2] for line in lines[1:3]] == [["100", "committed"], ["200", "committed"]]
    assert lines[-1] == "2 steps, 2 committed"
    rc, data = run_json(capsys, "ls", paths["root"])
    assert [(d["step"], d["committed"], d["tensors"]) for d in data] == [(100, True, 5), (200, True, 5)]
    assert all(d["world_size"] == 1 and d["layout"] == [] for d in data)  # saved by one process, no rules


def test_show(capsys, paths) -> None:
    w = _state()["model"]["layers"]["0"]["weight"].numpy()
    rc, out, _ = run(capsys, "show", paths["a"], "model.layers.0.weight", "0:3, 1:4")
    head, body = out.split("\n", 1)
    assert rc == 0 and head == "model.layers.0.weight[0:3, 1:4]: shape [3, 3], float32"
    with np.printoptions(floatmode="unique"):  # numpy's formatting, with its nan, every float as it reads back
        assert body == np.array2string(w[0:3, 1:4], separator=", ") + "\n"
    rc, data = run_json(capsys, "show", paths["a"], "model.layers.0.weight", "1, ::-7")
    assert rc == 0 and data["shape"] == [5] and data["index"] == "1, ::-7"
    want = w[1, ::-7]
    assert data["values"] == [("nan" if np.isnan(v) else float(v)) for v in want]
    rc, out, _ = run(capsys, "show", paths["a"], "model.layers.0.bias", "-3:")
    bias = _state()["model"]["layers"]["0"]["bias"].float().numpy()
    assert out.splitlines()[0] == "model.layers.0.bias[-3:]: shape [3], bfloat16 (shown as float32)"
    assert out.splitlines()[1] == np.array2string(bias[-3:], separator=", ")
    rc, out, _ = run(capsys, "show", paths["a"], "model.scale")
    assert out == "model.scale: shape [], float32\n1.5\n"
    rc, data = run_json(capsys, "show", paths["a"], "model.layers.1.weight", "..., 2")
    assert data["values"] == [2, 6, 10] and data["dtype"] == "int32"
    rc, out, _ = run(capsys, "show", paths["a"], "model.layers.0.weight")  # big: numpy's summary
    assert rc == 0 and "..." in out and len(out) < 3000
    rc, out, _ = run(capsys, "show", paths["a"], "model.layers.0.weight", "--full")
    assert rc == 0 and "..." not in out and out.count("\n") >= 40


@pytest.mark.parametrize(
    "args, message",
    [
        (["model.layers.0.wieght"],
         "error: no tensor 'model.layers.0.wieght' in checkpoint {a} (did you mean 'model.layers.0.weight'"),
        (["step"], "error: no tensor 'step' in checkpoint {a} ('step' is one of its values, not a tensor)"),
        (["model.layers.0.weight", "1:2:3:4"], "error: bad selection '1:2:3:4': '1:2:3:4' is not a slice"),
        (["model.layers.0.weight", "os.system('x')"], "error: bad selection \"os.system('x')\""),
        (["model.layers.0.weight", "40"], "error: tensor 'model.layers.0.weight' of shape [40, 30]: index 40 is out of bounds"),
        (["model.layers.0.weight", "0, 0, 0"], "error: tensor 'model.layers.0.weight' of shape [40, 30]: too many indices"),
        (["model.layers.0.weight", ":, :", "--limit", "100"],
         "error: model.layers.0.weight[:, :] selects 1,200 elements, more than --limit 100: narrow the selection"),
    ],
)
def test_show_errors(capsys, paths, args: list[str], message: str) -> None:
    rc, out, err = run(capsys, "show", paths["a"], *args)
    assert rc == 2 and out == "" and err.startswith(message.format(a=paths["a"])) and err.count("\n") == 1, err


def test_stats(capsys, paths) -> None:
    ck = ucp_zarr.open(paths["a"])
    rc, data = run_json(capsys, "stats", paths["a"], "model.layers.*", "model.scale", "model.layers.0.bias")
    keys = ["model.layers.0.weight", "model.layers.0.bias", "model.layers.1.weight", "model.scale"]
    assert rc == 0 and [d["key"] for d in data] == keys  # each key once, in the order asked
    assert data == [json.loads(json.dumps(I.tensor_stats(ck, k).to_dict())) for k in keys]
    assert data[0]["nan"] == 1 and (data[2]["min"], data[2]["max"]) == (0, 11)
    rc, out, err = run(capsys, "stats", paths["a"], "model.layers.0.weight")
    lines = out.splitlines()
    assert rc == 0 and err == "" and lines[0].split() == ["key", "dtype", "shape", "min", "max", "mean", "std", "norm", "nan", "inf"]
    s = I.tensor_stats(ck, "model.layers.0.weight")
    assert lines[1].split() == ["model.layers.0.weight", "float32", "40x30", f"{s.min:.6g}", f"{s.max:.6g}", f"{s.mean:.6g}",
                                f"{s.std:.6g}", f"{s.norm:.6g}", "1", "0"]
    rc, out, err = run(capsys, "stats", paths["a"], "model.layers.0.weight", "optim.*.nope")
    assert rc == 2 and out == "" and err == f"error: no tensor of {paths['a']} matches 'optim.*.nope'\n"


def _damage(path: Path, key: str) -> None:
    ck = ucp_zarr.open(path)
    shard = sorted(p for p in (path / ck.array_path(key)).rglob("*") if p.is_file() and p.name != "zarr.json")[0]
    raw = bytearray(shard.read_bytes())
    raw[3] ^= 0x10
    shard.write_bytes(bytes(raw))


def test_verify(capsys, paths, tmp_path) -> None:
    nbytes = ucp_zarr.open(paths["a"]).nbytes()
    rc, out, err = run(capsys, "verify", paths["a"])
    assert rc == 0 and out.startswith(f"ok: 5 tensors, {nbytes} bytes checked in ") and out.endswith(" s (unsigned)\n")
    rc, data = run_json(capsys, "verify", paths["a"])
    assert rc == 0 and data["ok"] is True and data["bytes"] == nbytes and data["tensors"] == 5
    bad = tmp_path / "bad"
    shutil.copytree(paths["a"], bad)
    _damage(bad, "model.layers.0.weight")
    rc, out, err = run(capsys, "verify", bad)
    assert rc == 1 and out == "" and err.startswith("error: verify FAILED: crc32c mismatch in ") and "model.layers.0.weight" in err
    rc, out, err = run(capsys, "verify", bad, "--json")
    data = json.loads(out)
    assert rc == 1 and data["ok"] is False and "crc32c mismatch" in data["error"]


def test_verify_with_key_file(capsys, tmp_path) -> None:
    ucp_zarr.save({"w": torch.ones(3)}, tmp_path / "signed", hmac_key=b"k" * 32)
    (tmp_path / "key").write_bytes(b"k" * 32)
    rc, out, _ = run(capsys, "verify", tmp_path / "signed", "--key-file", tmp_path / "key")
    assert rc == 0 and "(signature verified)" in out
    (tmp_path / "other").write_bytes(b"x" * 32)
    rc, out, err = run(capsys, "info", tmp_path / "signed", "--key-file", tmp_path / "other")
    assert rc == 2 and "signature does not verify" in err and err.startswith("error: ")
    rc, out, err = run(capsys, "verify", tmp_path / "signed", "--key-file", tmp_path / "missing")
    assert rc == 2 and err.startswith(f"error: cannot read the key file {tmp_path / 'missing'}: No such file")


def test_diff(capsys, paths) -> None:
    rc, out, err = run(capsys, "diff", paths["a"], paths["a"])
    assert rc == 0 and out == "identical: 5 equal; 0 value(s) differ\n"
    rc, out, err = run(capsys, "diff", paths["a"], paths["b"])
    lines = out.splitlines()
    assert rc == 1 and err == ""
    assert lines[0].split() == ["key", "status", "a", "b", "ndiff", "max_abs", "max_rel", "nan_mismatch"]
    assert lines[1].split()[:8] == ["model.layers.0.weight", "differs", "40x30", "float32", "40x30", "float32", "1", "1"]
    assert lines[2].split() == ["model.scale", "only_a", "()", "float32", "-", "-", "-", "-", "-"]
    assert lines[3] == "value step: differs: 5 -> 6"
    assert lines[4] == "different: 3 equal, 1 differs, 1 only_a; 1 value(s) differ"
    rc, out, _ = run(capsys, "diff", paths["a"], paths["b"], "--all")
    assert rc == 1 and "model.layers.0.bias" in out and "equal" in out
    rc, data = run_json(capsys, "diff", paths["a"], paths["b"])
    assert rc == 1 and data == json.loads(json.dumps(D.diff(paths["a"], paths["b"]).to_dict()))
    assert data["counts"]["differs"] == 1 and data["values"] == [{"key": "step", "status": "differs", "a": 5, "b": 6}]
    rc, data = run_json(capsys, "diff", paths["a"], paths["b"], "--keys", "model.layers.1", "--keys", "model.layers.0.b*")
    assert rc == 0 and [r["key"] for r in data["rows"]] == ["model.layers.0.bias", "model.layers.1.weight"]
    rc, out, err = run(capsys, "diff", paths["a"], paths["b"], "--keys", "zzz")
    assert rc == 2 and err == "error: no tensor of either checkpoint matches 'zzz'\n"


def test_progress(capsys, paths, tmp_path) -> None:
    """A tqdm bar on stderr with --progress (or on a terminal); none in logs (not a terminal)
    or with --no-progress."""
    ucp_zarr.export(paths["a"], tmp_path / "st", to="safetensors")
    commands = {
        "verify": lambda n: ["verify", paths["a"]],
        "stats": lambda n: ["stats", paths["a"], "model.*"],
        "diff": lambda n: ["diff", paths["a"], paths["b"]],
        "convert": lambda n: ["convert", tmp_path / "st", tmp_path / f"c{n}"],
        "export": lambda n: ["export", paths["a"], tmp_path / f"e{n}", "--to", "dcp"],
    }
    for name, args in commands.items():
        for n, flag in enumerate(["--progress", None, "--no-progress"]):
            rc, out, err = run(capsys, *args(n), *([flag] if flag else []))
            assert rc in (0, 1), (name, flag, err)
            if flag == "--progress":
                assert err.startswith(f"\r{name}:") and f"{name}: 100%|" in err and err.endswith("\n"), (name, err)
            else:
                assert err == "", (name, flag, err)


@pytest.mark.parametrize("cmd", ["info", "ls", "verify", "stats x", "show x"])
def test_bad_path(capsys, tmp_path, cmd: str) -> None:
    rc, out, err = run(capsys, *cmd.split()[:1], tmp_path / "nothing", *cmd.split()[1:])
    assert rc == 2 and out == "" and err == f"error: no checkpoint at {tmp_path / 'nothing'}\n"


def test_bad_options(capsys, paths) -> None:
    with pytest.raises(SystemExit) as e:
        main(["info", str(paths["a"]), "--storage-options", "{not json"])
    assert e.value.code == 2 and "--storage-options: not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["info", str(paths["a"]), "--storage-options", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err


def test_remote_checkpoint(capsys, paths) -> None:
    """fsspec URLs with --storage-options (an in-memory file system)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.put(str(paths["a"]), "/cli_remote/a", recursive=True)
    try:
        rc, data = run_json(capsys, "stats", "memory://cli_remote/a", "model.layers.1.weight", "--storage-options", "{}")
        assert rc == 0 and data[0]["max"] == 11
        rc, out, _ = run(capsys, "diff", "memory://cli_remote/a", paths["a"])
        assert rc == 0 and out.startswith("identical")
    finally:
        fs.rm("/cli_remote", recursive=True)


# --- processes ----------------------------------------------------------------------------------

_READ_ONLY = """
import contextlib, io, json, sys, time
import ucp_zarr.cli
a, b = sys.argv[1], sys.argv[2]
codes, times = [], {}
for args in (["info", a], ["ls", a], ["ls", a, "model.*", "--json"], ["show", a, "model.layers.0.bias", "0:4"],
             ["stats", a, "model.*"], ["verify", a], ["diff", a, b], ["info", a, "--json"]):
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        codes.append(ucp_zarr.cli.main(args + sys.argv[3:]))
    times[args[0]] = time.perf_counter() - t0
import ucp_zarr  # the package's torch-free names, and a tensor view's numpy face
names = [ucp_zarr.open, ucp_zarr.Checkpoint, ucp_zarr.TensorView, ucp_zarr.diff, ucp_zarr.CheckpointManager,
         ucp_zarr.optimal_interval, ucp_zarr.CheckpointError, ucp_zarr.__version__]
view = ucp_zarr.open(a)["model.layers.0.bias"]
view.stats(), view.numpy(slice(0, 3)), repr(view), view.ndim, view.numel()
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules, "hwm_kib": hwm, "times": times}))
"""


def _read_only_run(a: Path, b: Path, *extra: str, timeout: int = 120) -> dict:
    r = subprocess.run([PY, "-c", _READ_ONLY, str(a), str(b), *extra], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_read_only_commands_never_import_torch(paths) -> None:
    got = _read_only_run(paths["a"], paths["b"])
    assert got["codes"] == [0, 0, 0, 0, 0, 0, 1, 0] and got["torch"] is False


def test_errors_are_one_line_without_traceback(tmp_path) -> None:
    r = subprocess.run([PY, "-m", "ucp_zarr.cli", "show", str(tmp_path), "x"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and r.stderr == f"error: no checkpoint at {tmp_path}\n"
    (tmp_path / "zarr.json").write_text("{bad")
    r = subprocess.run([PY, "-m", "ucp_zarr.cli", "info", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1


def _seconds(cmd: list[str], runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_info_starts_fast(paths) -> None:
    """``ucp-zarr info`` against ``python -c "import zarr"`` (target: at most 1.5x; asserted
    with room for a loaded machine), and no torch."""
    script = shutil.which("ucp-zarr", path=os.path.dirname(PY)) or ""
    info = [script, "info", str(paths["a"])] if script else [PY, "-m", "ucp_zarr.cli", "info", str(paths["a"])]
    zarr_s, info_s = _seconds([PY, "-c", "import zarr"]), _seconds(info)
    print(f"\nstartup: ucp-zarr info {info_s:.3f} s, python -c 'import zarr' {zarr_s:.3f} s: {info_s / zarr_s:.2f}x")
    assert info_s < 2.5 * zarr_s


# --- several GiB --------------------------------------------------------------------------------


def test_multi_gib_checkpoint_in_bounded_memory(tmp_path) -> None:
    """A 2 GiB checkpoint: info, ls, show, stats, verify and diff run in a process whose peak
    RSS stays far below it (the tensors are 512 MiB each)."""
    if shutil.disk_usage(tmp_path).free < 6 << 30:
        pytest.skip("needs 6 GiB of free disk")
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(1, 16384, generator=g) for _ in range(4)]
    # expanded rows: 2 GiB of tensors from 256 KiB of memory (saving copies chunk by chunk)
    state = {"model": {f"w{i}": r.expand(8192, 16384) for i, r in enumerate(rows)}, "step": 1}
    path = tmp_path / "big"
    try:
        ucp_zarr.save(state, path)
        _check_big(path, rows)
    finally:
        shutil.rmtree(path, ignore_errors=True)  # (pytest keeps the temp folders of recent runs)


def _check_big(path: Path, rows: list[torch.Tensor]) -> None:
    nbytes = ucp_zarr.open(path).nbytes()
    assert nbytes == 2 << 30
    code = textwrap.dedent("""
        import contextlib, io, json, sys, time
        import ucp_zarr.cli
        p = sys.argv[1]
        out = {}
        for args in (["info", p], ["ls", p], ["show", p, "model.w1", "8190:, 16380:"], ["stats", p, "model.*"],
                     ["verify", p], ["diff", p, p, "--keys", "model.w[12]"]):
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()) as f:
                rc = ucp_zarr.cli.main(args + ["--json"])
            out[args[0]] = {"rc": rc, "s": round(time.perf_counter() - t0, 2), "out": json.loads(f.getvalue())}
        out["hwm_kib"] = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
        out["torch"] = "torch" in sys.modules
        print(json.dumps(out))
    """)
    r = subprocess.run([PY, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    peak = got.pop("hwm_kib") << 10
    print(f"\n2 GiB checkpoint: peak RSS {peak / 2**20:.0f} MiB; " + ", ".join(f"{k} {v['s']} s" for k, v in got.items()
                                                                         if isinstance(v, dict)))
    assert got.pop("torch") is False
    assert all(v["rc"] == 0 for v in got.values()), {k: v["rc"] for k, v in got.items()}
    assert peak < 600 << 20 and peak < nbytes / 3
    assert got["info"]["out"]["nbytes"] == nbytes and len(got["ls"]["out"]) == 4
    assert got["show"]["out"]["values"] == [[float(v) for v in rows[1][0, 16380:]]] * 2
    assert len(got["stats"]["out"]) == 4
    for s, row in zip(got["stats"]["out"], rows):
        r64 = row.double()
        assert (s["count"], s["nan"], s["min"], s["max"]) == (8192 * 16384, 0, float(row.min()), float(row.max()))
        assert s["mean"] == pytest.approx(float(r64.mean()), rel=1e-9, abs=1e-12)
        assert s["std"] == pytest.approx(float(r64.std(unbiased=False)), rel=1e-9)
        assert s["norm"] == pytest.approx(float(r64.norm()) * 8192**0.5, rel=1e-9)
    assert got["verify"]["out"]["bytes"] == nbytes
    assert got["diff"]["out"]["equal"] is True and got["diff"]["out"]["counts"]["equal"] == 2


def test_per_rank_state(capsys, tmp_path) -> None:
    ucp_zarr.save({"rng": ucp_zarr.PerRank(torch.arange(5)), "x": torch.ones(2)}, tmp_path / "pr")
    rc, data = run_json(capsys, "show", tmp_path / "pr", "rng", "--rank", "0", "1:")
    assert rc == 0 and data["values"] == [1, 2, 3, 4]
    rc, data = run_json(capsys, "stats", tmp_path / "pr", "rng", "--rank", "0")
    assert rc == 0 and (data[0]["min"], data[0]["max"]) == (0, 4)
    rc, out, err = run(capsys, "show", tmp_path / "pr", "rng", "--rank", "3")
    assert rc == 2 and err == "error: tensor 'rng' has no copy of rank 3; saved ranks: [0]\n"
    rc, out, _ = run(capsys, "ls", tmp_path / "pr")
    assert rc == 0 and "1 x 1 ranks" in out


def test_closed_pipe_is_quiet(tmp_path) -> None:
    """``ucp-zarr show ... | head -1``: the command stops when its reader goes, without a traceback."""
    ucp_zarr.save({"w": torch.randn(200, 200)}, tmp_path / "ck")
    p = subprocess.Popen([PY, "-m", "ucp_zarr.cli", "show", str(tmp_path / "ck"), "w", "--full"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().startswith(b"w: shape [200, 200]")
    p.stdout.close()
    err = p.stderr.read() if p.stderr else b""
    assert p.wait(timeout=60) == 141 and err == b""


# --- folders that are no checkpoint ------------------------------------------------------------


def test_folders_of_checkpoints_are_listed(capsys, tmp_path) -> None:
    """The parent of ``ckpt/step_100`` (the README's naming, not a manager's), and a folder of
    checkpoints at several depths beside other things (a foreign Zarr group, hidden folders,
    plain files): ``info`` and ``ls`` list the checkpoints, not 'an incomplete checkpoint'."""
    import zarr

    for step in (100, 200):
        ucp_zarr.save({"model": {"w": torch.ones(3, 4)}, "step": step}, tmp_path / "ckpt" / f"step_{step}")
    runs = tmp_path / "runs"
    ucp_zarr.save({"w": torch.ones(3)}, runs / "a")
    ucp_zarr.save({"w": torch.ones(5), "step": 7}, runs / "b" / "final")
    ucp_zarr.save({"w": torch.ones(2)}, runs / ".hidden" / "x")
    zarr.open_group(str(runs / "group"), mode="w").create_array("x", shape=(2,), dtype="f4")
    ucp_zarr.save({"w": torch.ones(1)}, runs / "group" / "inner")  # a checkpoint inside a foreign Zarr group
    (runs / "notes.txt").write_text("hello")
    for cmd in ("info", "ls"):
        rc, out, err = run(capsys, cmd, tmp_path / "ckpt")
        lines = out.splitlines()
        assert rc == 0 and err == "" and lines[0].split() == ["path", "state", "step", "size", "tensors", "ranks", "created"]
        assert [line.split()[:5] for line in lines[1:3]] == [["step_100", "committed", "100", "48", "B"],
                                                            ["step_200", "committed", "200", "48", "B"]]
        assert lines[3] == f"2 checkpoints in {tmp_path / 'ckpt'} (2 committed): ucp-zarr info {tmp_path / 'ckpt'}/PATH for one"
        rc, data = run_json(capsys, cmd, runs)
        assert rc == 0 and [(d["path"], d["state"], d["step"], d["tensors"], d["nbytes"]) for d in data] == [
            ("a", "committed", None, 1, 12), ("b/final", "committed", 7, 1, 20), ("group/inner", "committed", None, 1, 4)]
    rc, out, err = run(capsys, "info", runs / "b")  # one level above a checkpoint
    assert rc == 0 and out.splitlines()[1].split()[:3] == ["final", "committed", "7"]


def test_a_manager_root_lists_its_steps_in_info_too(capsys, paths) -> None:
    rc, out, err = run(capsys, "info", paths["root"])
    assert rc == 0 and err == "" and out.splitlines()[-1] == "2 steps, 2 committed"


def test_an_unfinished_save_is_still_called_incomplete(capsys, tmp_path, monkeypatch) -> None:
    """A folder holding a save that never committed is not a folder of checkpoints."""
    from ucp_zarr.protocol import saver

    ucp_zarr.save({"w": torch.ones(3)}, tmp_path / "run" / "a")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # (not cleaned up, as after a kill)

    monkeypatch.setattr(saver.PreparedSave, "_abort", lambda self: None)
    monkeypatch.setattr(saver, "write_shard", crash)
    with pytest.raises(KeyboardInterrupt):
        ucp_zarr.save({"w": torch.ones(3)}, tmp_path / "run" / "b")
    monkeypatch.undo()
    rc, out, err = run(capsys, "ls", tmp_path / "run" / "b")
    assert rc == 2 and err.startswith(f"error: {tmp_path / 'run' / 'b'} holds an incomplete checkpoint")
    rc, data = run_json(capsys, "ls", tmp_path / "run")
    assert rc == 0 and [(d["path"], d["state"]) for d in data] == [("a", "committed"), ("b", "incomplete")]


def test_other_systems_checkpoints_are_named_with_the_convert_command(capsys, tmp_path) -> None:
    """A DCP folder (torch's dcp.save), a DeepSpeed folder (DeepSpeed's save_checkpoint), a
    safetensors file and folder: info/ls say what they are and how to convert them."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    import ds_checkpoints

    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    save_file({"w": torch.ones(2)}, str(tmp_path / "st.safetensors"))
    (tmp_path / "stdir").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "stdir" / "model.safetensors"))
    cases = {tmp_path / "dcp": "dcp", ds_checkpoints.checkpoint(1, "fp32"): "deepspeed",
             tmp_path / "st.safetensors": "safetensors", tmp_path / "stdir": "safetensors"}
    for path, kind in cases.items():
        for cmd in ("info", "ls"):
            rc, out, err = run(capsys, cmd, path)
            assert rc == 2 and out == "" and err == (
                f"error: {path} holds a checkpoint of kind {kind!r}, not a ucp_zarr checkpoint: convert it with "
                f"`ucp-zarr convert {path} DST` (see ucp-zarr convert --help)\n"), (path, err)


# --- messages in the command line's words -----------------------------------------------------------


def test_errors_name_options_not_keywords(capsys, paths, tmp_path) -> None:
    """The fix an error names is this command's option; Python users see the keyword."""
    import datetime

    rc, out, err = run(capsys, "info", paths["a"], "--storage-options", '{"anon": true}')
    assert rc == 2 and err.startswith("error: --storage-options ['anon'] do not apply to the local path")
    with pytest.raises(ValueError, match=r"^storage_options \['anon'\] do not apply"):
        ucp_zarr.open(paths["a"], storage_options={"anon": True})

    ucp_zarr.export(paths["a"], tmp_path / "st", to="safetensors")
    assert run(capsys, "convert", tmp_path / "st", tmp_path / "c")[0] == 0
    rc, out, err = run(capsys, "convert", tmp_path / "st", tmp_path / "c")
    assert rc == 2 and err == f"error: a checkpoint is already committed at {tmp_path / 'c'}; choose a new path or pass --overwrite\n"
    assert run(capsys, "convert", tmp_path / "st", tmp_path / "c", "--overwrite")[0] == 0
    with pytest.raises(ucp_zarr.CheckpointExistsError, match="or pass overwrite=True$"):
        ucp_zarr.convert(tmp_path / "st", tmp_path / "c")

    rc, out, err = run(capsys, "export", paths["a"], tmp_path / "st", "--to", "safetensors")
    assert rc == 2 and err == f"error: {tmp_path / 'st'} already exists; pass --overwrite to replace it\n"

    torch.save({"w": torch.ones(2), "when": datetime.date(2026, 1, 1)}, tmp_path / "sd.pt")
    rc, out, err = run(capsys, "convert", tmp_path / "sd.pt", tmp_path / "c2")
    assert rc == 2 and err.endswith("runs code from the file: pass --trust only if you trust where it came from\n")
    with pytest.raises(ucp_zarr.UntrustedInputError, match="pass trust=True only if you trust"):
        ucp_zarr.convert(tmp_path / "sd.pt", tmp_path / "c2")
    rc, out, err = run(capsys, "convert", tmp_path / "sd.pt", tmp_path / "c2", "--trust")  # unpickled, then refused
    assert rc == 2 and "of type date is neither a tensor nor JSON-able" in err

    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "x.bin").write_bytes(b"x")
    rc, out, err = run(capsys, "convert", tmp_path / "odd", tmp_path / "c3")
    assert rc == 2 and "recognises; say which with --from (one of ['dcp', " in err


def test_a_keyword_without_an_option_says_so() -> None:
    from ucp_zarr.cli import _spelling
    from ucp_zarr.errors import Keyword, OwnershipError, render

    e = OwnershipError("x is being written; pass ", Keyword("overwrite_incomplete", True), " if it is dead")
    assert str(e) == "x is being written; pass overwrite_incomplete=True if it is dead"
    spell = _spelling(build_parser().commands["convert"])
    assert render(e, spell) == ("x is being written; pass overwrite_incomplete=True (in Python: `ucp-zarr convert` "
                                "has no option for it) if it is dead")
    assert spell(Keyword("max_workers", 8)) == "--workers 8" and spell(Keyword("source")) == "--from"
    assert _spelling(build_parser().commands["verify"])(Keyword("hmac_key")) == "--key-file"


# --- the Python face ----------------------------------------------------------------------------------


def test_a_key_typo_in_python_suggests_close_keys(paths) -> None:
    ck = ucp_zarr.open(paths["a"])
    with pytest.raises(KeyError) as e:
        ck["model.layers.0.wieght"]
    assert isinstance(e.value, ucp_zarr.CheckpointError)
    assert str(e.value) == (f"no tensor 'model.layers.0.wieght' in checkpoint {paths['a']} "
                            "(did you mean 'model.layers.0.weight', 'model.layers.1.weight', 'model.layers.0.bias'?)")
    with pytest.raises(KeyError, match=r"'step' is one of its values, not a tensor"):
        ck.read("step")


def test_save_result_repr_is_one_line(tmp_path) -> None:
    result = ucp_zarr.save({f"w{i}": torch.ones(2) for i in range(50)}, tmp_path / "ck")
    assert repr(result) == (f"SaveResult(url={str(tmp_path / 'ck')!r}, rank=0, bytes_written={result.bytes_written}, "
                            f"objects=<{len(result.objects)} keys>, save_id={result.save_id!r})")
    assert len(result.objects) > 100


def test_stats_of_overflowing_values_and_of_a_tied_alias(tmp_path, capsys) -> None:
    """``stats --json`` of a tensor whose std and norm overflow to inf gives strict JSON
    ("inf", as the norm already was; before: exit 2, "Out of range float values are not JSON
    compliant"); ``stats`` of the alias of a tied tensor reads the tensor it names, as
    ``show`` does (before: "no tensor ... matches")."""
    w = torch.ones(3)
    ucp_zarr.save({"big": torch.tensor([1e200, -1e200], dtype=torch.float64), "wte": w, "lm_head": w}, tmp_path / "ck")
    rc, out = run_json(capsys, "stats", tmp_path / "ck", "big")
    assert rc == 0 and out[0]["std"] == "inf" and out[0]["norm"] == "inf" and out[0]["max"] == 1e200
    rc, out = run_json(capsys, "stats", tmp_path / "ck", "lm_head")
    assert rc == 0 and out[0]["key"] == "lm_head" and out[0]["mean"] == 1.0
    # ls of the alias lists the tensor it reads under its name (before: "no tensor ... matches"), info --json the ties
    rc, out = run_json(capsys, "ls", tmp_path / "ck", "lm_head")
    assert rc == 0 and [(r["key"], r["shape"], r["nbytes"]) for r in out] == [("lm_head", [3], 12)]
    rc, out = run_json(capsys, "info", tmp_path / "ck")
    assert rc == 0 and out["ties"] == {"lm_head": "wte"}


def test_a_key_holding_glob_characters_selects_itself(capsys, tmp_path) -> None:
    """A pattern that spells a stored key selects that key, even where it holds ``[``, ``*`` or
    ``?`` (before: ``stats ck 'model.w[0]'`` read ``model.w0``, and ``diff --keys`` compared
    it, exit 0); a pattern that spells no key is still a glob."""
    ck = tmp_path / "ck"
    ucp_zarr.save({"model": {"w[0]": torch.full((4,), 7.0), "w0": torch.full((4,), -1.0), "w*": torch.zeros(2)}}, ck)
    rc, out = run_json(capsys, "stats", ck, "model.w[0]")
    assert rc == 0 and [(r["key"], r["min"]) for r in out] == [("model.w[0]", 7.0)]
    rc, out = run_json(capsys, "stats", ck, "model.w*")
    assert rc == 0 and [r["key"] for r in out] == ["model.w*"]
    rc, out = run_json(capsys, "stats", ck, "model.w?")  # (no such key: a glob)
    assert rc == 0 and sorted(r["key"] for r in out) == ["model.w*", "model.w0"]
    assert [r.key for r in D.diff(ck, ck, keys="model.w[0]").rows] == ["model.w[0]"]
    assert [r.key for r in I.list_tensors(ucp_zarr.open(ck), "model.w[0]")] == ["model.w[0]"]


def test_a_key_holding_a_newline_stays_on_its_row(capsys, tmp_path) -> None:
    """Control characters in a key are escaped in tables (before: ``ls`` broke the row in two,
    and the half after the newline read as another tensor); JSON keeps the key as it is."""
    ck = tmp_path / "ck"
    ucp_zarr.save({"model": {"a\nb": torch.ones(2), "c": torch.ones(3)}}, ck)
    rc, out, _ = run(capsys, "ls", ck)
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 4 and lines[1].split()[0] == "model.a\\nb", lines
    rc, data = run_json(capsys, "ls", ck)
    assert [d["key"] for d in data] == ["model.a\nb", "model.c"]


def test_convert_export_and_diff_with_an_object_store(tmp_path, capsys, seaweed) -> None:
    """``convert`` to and ``export`` from an s3:// URL take ``--storage-options`` (for the URL;
    before: "unrecognized arguments"), and ``diff LOCAL s3://...`` applies them to the remote
    side only (before: refused for the local path, and unreachable without them)."""
    import uuid

    from safetensors.torch import load_file, save_file

    tensors = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    url, options = f"s3://objstore/cli-{uuid.uuid4().hex[:8]}/ck", json.dumps(seaweed.storage_options())
    assert run(capsys, "convert", tmp_path / "m.safetensors", url, "--storage-options", options)[0] == 0
    assert run(capsys, "convert", tmp_path / "m.safetensors", tmp_path / "local")[0] == 0
    assert run(capsys, "export", url, tmp_path / "out.safetensors", "--to", "safetensors", "--storage-options", options)[0] == 0
    assert all(torch.equal(load_file(str(tmp_path / "out.safetensors"))[k], v) for k, v in tensors.items())
    rc, out, _ = run(capsys, "diff", tmp_path / "local", url, "--storage-options", options)
    assert rc == 0 and "identical" in out, out


# --- what reaches the terminal --------------------------------------------------------------


def test_value_keys_reach_the_terminal_escaped(capsys, tmp_path: Path) -> None:
    """A value key holding an escape sequence (clear the screen, set the window title) is
    printed as its escape by ``diff`` and ``info``, as tensor keys are in every table."""
    evil = "lr\x1b[2J\x1b]0;pwned\x07"
    for name, lr in (("a", 1), ("b", 2)):
        ucp_zarr.save({evil: lr, "rng\x1b[31m": ucp_zarr.PerRank(5), "x": torch.ones(2)}, tmp_path / name)
    rc, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert "\x1b" not in out and "\x07" not in out and "lr\\x1b[2J" in out, out
    rc, out, _ = run(capsys, "info", tmp_path / "a")
    assert "\x1b" not in out and "rng\\x1b[31m" in out, out


def test_show_prints_floats_that_read_back(capsys, tmp_path: Path) -> None:
    """``show`` prints each float as the shortest text that reads back as its stored value:
    numpy's default (8 digits) printed 1.0 and 1.000000001 both as ``1.``."""
    t = torch.tensor([1.0, 1.000000001, -2.5e-300], dtype=torch.float64)
    ucp_zarr.save({"x": t}, tmp_path / "ck")
    rc, out, _ = run(capsys, "show", tmp_path / "ck", "x")
    assert rc == 0
    body = out.splitlines()[1].strip("[]").split(",")
    assert [float(v) for v in body] == t.tolist()


def test_export_keys_leaves_per_rank_state_out(capsys, tmp_path: Path) -> None:
    """safetensors and DCP hold one tensor or value per key: a checkpoint with per-rank state is
    refused naming it and ``--keys``, which the command lacked (no way to export it)."""
    from safetensors.torch import load_file

    ucp_zarr.save({"w": torch.arange(4.0), "rng": ucp_zarr.PerRank({"seed": 5}), "step": 3}, tmp_path / "ck")
    rc, _, err = run(capsys, "export", tmp_path / "ck", tmp_path / "a.safetensors", "--to", "safetensors")
    assert rc == 2 and "['rng'] are per-rank state" in err and "--keys" in err
    rc, _, err = run(capsys, "export", tmp_path / "ck", tmp_path / "b.safetensors", "--to", "safetensors",
                     "--keys", "w", "--keys", "step")
    assert rc == 0, err
    assert torch.equal(load_file(tmp_path / "b.safetensors")["w"], torch.arange(4.0))
    rc, _, err = run(capsys, "export", tmp_path / "ck", tmp_path / "hf", "--to", "hf", "--keys", "w")
    assert rc == 2 and "keys" in err  # (a format that takes no keys refuses the option)
