"""A ucp_zarr checkpoint is plain Zarr v3: zarr-python and TensorStore read it without ucp_zarr.

The checkpoint is written here by ucp_zarr; the reading happens in a separate Python process
that never imports ucp_zarr (a meta-path hook makes any attempt fail, since the package is
installed editable in the venv). That process discovers the
arrays from the root ``zarr.json`` alone, opens them with ``zarr.open_array`` / ``zarr.open_group``
and with TensorStore's ``zarr3`` driver, reads full and partial selections and compares them
bit for bit with expected values that this process wrote as ``.npy`` files.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import ucp_zarr

pytest.importorskip("zarr")
pytest.importorskip("tensorstore")
pytest.importorskip("ml_dtypes")

CHUNK_BYTES = 16384
BIG_KEY = "extra.big"
EDGE_KEY = "extra.edge"

# dtypes whose Zarr array holds the raw bits (documented in ucp_zarr/format/dtypes.py)
_BITS = {torch.bfloat16: np.uint16, torch.float8_e4m3fn: np.uint8}


def _model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 40),
        torch.nn.LayerNorm(40),
        torch.nn.GELU(),
        torch.nn.Linear(40, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        loss = model(torch.randn(8, 24)).pow(2).mean()
        loss.backward()
        opt.step()
    return model, opt


def _special(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Random values of ``dtype`` plus the values that bit-exactness is about (nan, inf, -0)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) * 3
    t[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    if dtype == torch.float8_e4m3fn:  # no inf in e4m3fn; the cast would give nan
        t[2:4] = torch.tensor([448.0, -448.0])
    return t.to(dtype)


def _state_dict() -> dict:
    model, opt = _model_and_adam()
    g = torch.Generator().manual_seed(1)
    extra = {
        "f32": _special(torch.float32, 37, 2),
        "f16": _special(torch.float16, 33, 3).reshape(3, 11),
        "bf16": _special(torch.bfloat16, 45, 4).reshape(5, 9),
        "f8": _special(torch.float8_e4m3fn, 29, 5),
        "i64": torch.randint(-(2**62), 2**62, (4, 6), generator=g, dtype=torch.int64),
        "flags": torch.rand(17, 3, generator=g) > 0.5,
        "scalar": torch.tensor(-7, dtype=torch.int64),
        # 2-D, big enough for several chunks at CHUNK_BYTES; its rows do not divide evenly
        "big": torch.randn(301, 70, generator=g),
        # bf16 over several chunks too, with partial edge chunks in both dims
        "edge": _special(torch.bfloat16, 509 * 37, 6).reshape(509, 37),
    }
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra, "step": 2}


def _flat_tensors(sd: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, torch.Tensor):
            out[prefix] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, list) and any(isinstance(x, (dict, torch.Tensor)) for x in v):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)

    walk("", sd)
    return out


def _raw_numpy(t: torch.Tensor) -> np.ndarray:
    """The stored form of ``t`` as numpy: native dtypes as is, bf16/fp8 as their raw bits."""
    t = t.detach().cpu().contiguous()
    if t.dtype in _BITS:
        t = t.view({np.uint16: torch.uint16, np.uint8: torch.uint8}[_BITS[t.dtype]])
    return t.numpy()


def _selections(shape: tuple[int, ...]) -> list[list]:
    """Partial selections, as per-dim [start, stop, step] or an int, all non-negative so
    that TensorStore (whose negative indices are literal coordinates) reads the same."""
    if not shape:
        return []
    sels: list[list] = []
    first = [[1, max(1, shape[0] - 1), 1]] + [[0, n, 1] for n in shape[1:]]
    sels.append(first)
    sels.append([shape[0] // 2] + [[0, n, 1] for n in shape[1:]])
    if len(shape) >= 2:
        a, b = shape[0], shape[1]
        sels.append([[a // 5, a - a // 7, 3], [b // 4, b - 1, 2]] + [[0, n, 1] for n in shape[2:]])
        sels.append([[0, a, 7], b - 1] + [[0, n, 1] for n in shape[2:]])
        sels.append([[a - 3, a, 1], [0, min(b, 5), 1]] + [[0, n, 1] for n in shape[2:]])
    else:
        sels.append([[0, shape[0], 4]])
        sels.append([[shape[0] - 1, shape[0], 1]])
    return sels


def _apply(a: np.ndarray, sel: list) -> np.ndarray:
    return a[tuple(slice(*s) if isinstance(s, list) else s for s in sel)]


@pytest.fixture(scope="module", params=[None, 1 << 16], ids=["one-shard", "many-shards"])
def saved(request, tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """Save the checkpoint, and write the expected arrays + a manifest for the reader process."""
    base = tmp_path_factory.mktemp("other_readers")
    root = base / "ckpt"
    sd = _state_dict()
    kwargs = {} if request.param is None else {"shard_bytes": request.param}
    ucp_zarr.save(sd, root, chunk_bytes=CHUNK_BYTES, **kwargs)

    tensors = _flat_tensors(sd)
    ck = ucp_zarr.open(root)
    assert set(ck.keys()) == set(tensors)
    big = ck.array_meta(BIG_KEY).grid
    assert big.sharded and math.prod(big.chunks_per_shard) > 1, big
    if request.param is not None:
        assert math.prod(big.shard_counts) > 1, big

    expected = base / "expected"
    expected.mkdir()
    manifest = {}
    for i, (key, t) in enumerate(tensors.items()):
        raw = _raw_numpy(t)
        np.save(expected / f"{i}.npy", raw)
        entry = {
            "npy": f"{i}.npy",
            "path": ck.array_path(key),
            "torch_dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "selections": _selections(tuple(t.shape)),
            "shards": list(ck.array_meta(key).grid.shard_shape),
        }
        if t.dtype in _BITS:
            # the decoded values, to check the documented reinterpretation gives numbers
            np.save(expected / f"{i}.f32.npy", t.float().numpy())
            entry["f32_npy"] = f"{i}.f32.npy"
        manifest[key] = entry
    (base / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return base, root, tensors


# Prepended to the reader: ucp_zarr is installed (editable) in the venv, so make importing it
# fail loudly instead of relying on it being absent from sys.path.
BLOCK_UCP_ZARR = textwrap.dedent(
    r'''
    import sys

    class _NoUcpZarr:
        def find_spec(self, name, path=None, target=None):
            if name == "ucp_zarr" or name.startswith("ucp_zarr."):
                raise ImportError("the reader process must not import ucp_zarr")
            return None

    sys.meta_path.insert(0, _NoUcpZarr())
    '''
)

READER = BLOCK_UCP_ZARR + textwrap.dedent(
    r'''
    import json, sys
    from pathlib import Path

    import ml_dtypes
    import numpy as np
    import tensorstore as ts
    import torch
    import zarr

    base, root = Path(sys.argv[1]), sys.argv[2]
    manifest = json.loads((base / "manifest.json").read_text())
    exp_dir = base / "expected"

    def bits(a):
        """A view of ``a`` as unsigned ints of its width (bool stays bool): compares bit for bit."""
        a = np.asarray(a)
        return a if a.dtype == np.bool_ else a.view(f"u{a.dtype.itemsize}")

    def same(got, want, what):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
        assert got.shape == want.shape, (what, got.shape, want.shape)
        assert np.array_equal(bits(got), bits(want)), what

    def pick(a, sel):
        return a[tuple(slice(*s) if isinstance(s, list) else s for s in sel)]

    # 1. discover the tensors from the root zarr.json alone (the commit record)
    root_doc = json.loads((Path(root) / "zarr.json").read_text())
    assert root_doc["zarr_format"] == 3 and root_doc["node_type"] == "group"
    index = root_doc["attributes"]["ucp_zarr"]["tensors"]
    assert set(index) == set(manifest), sorted(set(index) ^ set(manifest))

    group = zarr.open_group(root, mode="r")
    assert group.attrs["ucp_zarr"]["tensors"] == index

    checked = 0
    for key, m in manifest.items():
        path = index[key]["path"]
        assert path == m["path"], (key, path, m["path"])
        assert index[key]["shape"] == m["shape"] and index[key]["dtype"] == m["torch_dtype"]
        want = np.load(exp_dir / m["npy"])

        # 2. zarr-python, three ways in: a path, a store + path, the group hierarchy
        za = zarr.open_array(f"{root}/{path}", mode="r")
        zb = zarr.open_array(store=root, path=path, mode="r")
        zg = group[path]
        assert isinstance(zg, zarr.Array), key
        for z in (za, zb, zg):
            assert list(z.shape) == m["shape"], key
            assert z.attrs["ucp_zarr"]["key"] == key
            assert z.attrs["ucp_zarr"]["torch_dtype"] == m["torch_dtype"]
        assert za.shards is not None and list(za.shards) == m["shards"], (key, za.shards)  # every array is sharded
        same(za[...], want, f"zarr full {key}")
        same(zg[...], want, f"zarr group full {key}")
        for sel in m["selections"]:
            same(pick(za, sel), pick(want, sel), f"zarr {key} {sel}")

        # 3. TensorStore zarr3 driver on a file kvstore
        t = ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{root}/{path}"}},
            read=True,
        ).result()
        assert list(t.shape) == m["shape"], key
        tfull = t.read().result()
        same(tfull, want, f"tensorstore full {key}")
        for sel in m["selections"]:
            idx = tuple(slice(*s) if isinstance(s, list) else s for s in sel)
            same(t[idx].read().result(), pick(want, sel), f"tensorstore {key} {sel}")

        # 4. the documented one-liners for dtypes stored as raw bits
        if m["torch_dtype"] == "bfloat16":
            a = za[...]
            assert a.dtype == np.uint16
            tt = torch.from_numpy(a).view(torch.bfloat16)
            ref = torch.from_numpy(want).view(torch.bfloat16)
            assert tt.dtype == torch.bfloat16 and torch.equal(tt.view(torch.int16), ref.view(torch.int16))
            f32 = np.load(exp_dir / m["f32_npy"])
            assert np.array_equal(tt.float().numpy(), f32, equal_nan=True), key
            assert np.array_equal(a.view(ml_dtypes.bfloat16).astype(np.float32), f32, equal_nan=True), key
            assert np.array_equal(tfull.view(ml_dtypes.bfloat16).astype(np.float32), f32, equal_nan=True)
        elif m["torch_dtype"] == "float8_e4m3fn":
            a = za[...]
            assert a.dtype == np.uint8
            tt = torch.from_numpy(a).view(torch.float8_e4m3fn)
            f32 = np.load(exp_dir / m["f32_npy"])
            assert np.array_equal(tt.float().numpy(), f32, equal_nan=True), key
            assert np.array_equal(a.view(ml_dtypes.float8_e4m3fn).astype(np.float32), f32, equal_nan=True)
        checked += 1

    assert "ucp_zarr" not in sys.modules, "the reader process imported ucp_zarr"
    print(f"OK {checked}")
    '''
)


def test_plain_zarr_and_tensorstore_read_bit_exact(saved):
    base, root, tensors = saved
    script = base / "reader.py"
    script.write_text(READER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(script), str(base), str(root)],
        cwd=base,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"reader failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip() == f"OK {len(tensors)}", proc.stdout


def test_reader_process_cannot_import_ucp_zarr(saved):
    """Guards the test above: with the reader's prelude, importing ucp_zarr fails."""
    base, _, _ = saved
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = BLOCK_UCP_ZARR + textwrap.dedent(
        """
        try:
            import ucp_zarr.api
        except ImportError:
            print("blocked")
        else:
            print("imported")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=base,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "blocked"


def test_ucp_zarr_reads_back_the_same(saved):
    """The same expectations hold for ucp_zarr's own reader (so a reader mismatch is not ours)."""
    _, root, tensors = saved
    ck = ucp_zarr.open(root)
    for key, t in tensors.items():
        got = ck[key][...]
        assert got.dtype == t.dtype and got.shape == t.shape, key
        assert np.array_equal(_bits(got), _bits(t)), key
        for sel in _selections(tuple(t.shape)):
            idx = tuple(slice(*s) if isinstance(s, list) else s for s in sel)
            assert np.array_equal(_bits(ck[key][idx]), _bits(t[idx])), (key, sel)


def _bits(t: torch.Tensor) -> np.ndarray:
    a = _raw_numpy(t)
    return a if a.dtype == np.bool_ else a.view(f"u{a.dtype.itemsize}")
