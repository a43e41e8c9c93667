"""ucp_zarr.browse.inspect and the torch-free read path: values, selections, statistics, listings and
diffs on real checkpoints, checked against numpy and torch."""

from __future__ import annotations

import importlib
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import ucp_zarr
from ucp_zarr.browse import inspect as I
from ucp_zarr.browse import diff as D
from ucp_zarr.browse import values as V
from ucp_zarr.layout import Box

FP8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
SMALL = dict(chunk_bytes=1 << 9, shard_bytes=1 << 11)  # many chunks and shards per tensor


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(37, 29, generator=g)
    w[3, 4], w[5, 5], w[6, 7], w[30, 0] = float("nan"), float("inf"), float("-inf"), float("nan")
    return {
        "model": {
            "w": w,
            "bf": (torch.randn(41, 23, generator=g) * 100).bfloat16(),
            "f8": torch.randn(19, 7, generator=g).to(torch.float8_e4m3fn),
            "i64": torch.randint(-(2**40), 2**40, (33, 5), generator=g),
            "u8": torch.randint(0, 255, (50,), generator=g).to(torch.uint8),
            "c": torch.randn(9, 4, dtype=torch.complex64, generator=g),
            "flag": torch.rand(25, generator=g) > 0.5,
            "scalar": torch.tensor(-2.5),
            "empty": torch.zeros(0, 4),
            "nans": torch.full((6,), float("nan")),
            "h": torch.randn(3, 5, 7, generator=g).half(),
        },
        "step": 7,
        "lr": 0.5,
    }


@pytest.fixture(scope="module")
def ck_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inspect") / "a"
    ucp_zarr.save(_state(), path, **SMALL)
    return path


@pytest.fixture(scope="module")
def ck(ck_path: Path) -> ucp_zarr.Checkpoint:
    return ucp_zarr.open(ck_path)


def _reference(t: torch.Tensor) -> np.ndarray:
    """What inspect's values should be: bf16/fp8 exactly as float32, others native."""
    if t.dtype == torch.bfloat16 or "float8" in str(t.dtype):
        return t.float().numpy()
    return t.numpy()


# --- widening -------------------------------------------------------------------------------


def test_widen_bfloat16_every_bit_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = V.widen(bits, "bfloat16")
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # NaN payloads too


@pytest.mark.parametrize("name", FP8)
def test_widen_float8_every_bit_pattern(name: str) -> None:
    bits = np.arange(256, dtype=np.uint8)
    got = V.widen(bits, name)
    want = torch.from_numpy(bits).view(getattr(torch, name)).float().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok], want[ok]) and np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))


def test_read_numpy_is_torch_read(ck: ucp_zarr.Checkpoint) -> None:
    state = _state()["model"]
    for name, t in state.items():
        raw = ck.read_numpy(f"model.{name}")
        assert raw.shape == tuple(t.shape) and raw.dtype == np.dtype(ck.array_meta(f"model.{name}").dtype.zarr_dtype)
        assert np.array_equal(V.widen(raw, str(t.dtype).removeprefix("torch.")), _reference(t), equal_nan=True), name
    assert ck.read_numpy("model.scalar").shape == () and ck.read_numpy("model.scalar")[()] == -2.5
    with pytest.raises(IndexError, match="outside its shape"):
        ck.read_numpy("model.w", Box((30, 0), (10, 29)))


# --- blocks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("max_bytes", [1, 700, 5000, 1 << 20])
def test_iter_blocks_tile_the_tensor(ck: ucp_zarr.Checkpoint, max_bytes: int) -> None:
    for key in ("model.w", "model.bf", "model.h", "model.c", "model.scalar", "model.empty"):
        meta = ck.array_meta(key)
        full = V.widen(ck.read_numpy(key), meta.dtype.name)
        seen = np.zeros(meta.shape, dtype=np.int64)
        chunk_bytes = math.prod(meta.grid.chunk_shape) * full.dtype.itemsize
        for box, values in V.iter_blocks(ck, key, max_bytes=max_bytes):
            assert values.shape == box.shape and values.dtype == full.dtype
            assert np.array_equal(values, full[box.slices()], equal_nan=True)
            assert values.nbytes <= max(max_bytes, chunk_bytes)
            assert all(o % c == 0 for o, c in zip(box.offset, meta.grid.chunk_shape))  # chunk-aligned
            seen[box.slices()] += 1
        assert (seen == 1).all(), key  # every element exactly once


def test_block_shape() -> None:
    assert V.block_shape((100, 10), (8, 10), 4, 1 << 20) == (100, 10)  # all fits
    assert V.block_shape((100, 10), (8, 10), 4, 40 * 17) == (16, 10)  # whole rows, chunk multiples
    assert V.block_shape((100, 10), (8, 5), 4, 8) == (8, 5)  # at least one chunk
    # strips of whole chunks along dim 0 (read without a copy), when big enough
    assert V.block_shape((8192, 16384), (512, 2048), 4, 64 << 20) == (8192, 2048)
    assert V.block_shape((8192, 16384), (512, 2048), 4, 16 << 20) == (2048, 2048)
    assert V.block_shape((64, 64, 64), (4, 8, 16), 1, 64 * 8 * 16) == (64, 8, 16)
    # ...else the largest block cut from the leading dims
    assert V.block_shape((64, 64, 64), (4, 8, 16), 1, 4 * 64 * 64) == (4, 64, 64)
    assert V.block_shape((64, 64, 64), (4, 8, 16), 1, 4 * 64 * 32 + 1) == (4, 32, 64)
    assert V.block_shape((3, 10**6), (3, 4096), 4, 64 << 20) == (3, 10**6)
    assert V.block_shape((), (), 8, 1) == ()


# --- selections -------------------------------------------------------------------------------


def _random_index(rng: random.Random, shape: tuple[int, ...]) -> tuple:
    out: list = []
    for n in shape:
        kind = rng.random()
        if kind < 0.25 and n:
            out.append(rng.randrange(-n, n))
        else:
            bound = lambda: rng.choice([None, rng.randint(-n - 3, n + 3)])  # noqa: E731
            out.append(slice(bound(), bound(), rng.choice([None, 1, 2, 3, 7, -1, -2, -5])))
    if rng.random() < 0.3 and out:
        at = rng.randrange(len(out))
        out[at : at + rng.randint(0, len(out) - at)] = [Ellipsis]
    elif rng.random() < 0.3:
        out = out[: rng.randrange(len(out) + 1)]
    return tuple(out)


def test_selections_match_numpy(ck: ucp_zarr.Checkpoint) -> None:
    """Random basic selections, spelled as text, parsed, read: the same as numpy's indexing
    (and TensorView's, which returns torch tensors)."""
    rng = random.Random(5)
    state = _state()["model"]
    for key in ("w", "bf", "h", "u8", "c", "scalar"):
        ref = _reference(state[key])
        view = ck[f"model.{key}"]
        for _ in range(40):
            index = _random_index(rng, ref.shape)
            parsed = V.parse_index(V.format_index(index))
            assert parsed == index
            want = ref[index]
            assert V.selection_shape(ref.shape, index) == want.shape
            got = V.widen(ck.select_numpy(f"model.{key}", parsed), view.dtype_name)
            assert got.shape == want.shape and np.array_equal(got, want, equal_nan=True), (key, index)
            t = view[index]
            assert np.array_equal(_reference(t) if t.dim() else _reference(t.reshape(1))[0], want, equal_nan=True)


@pytest.mark.parametrize(
    "text, index",
    [("", ()), ("3", (3,)), ("-1", (-1,)), ("3:5, 0:4", (slice(3, 5), slice(0, 4))), (":, ::2", (slice(None), slice(None, None, 2))),
     ("[1, ...]", (1, Ellipsis)), ("..., -2:", (Ellipsis, slice(-2, None))), ("::-1", (slice(None, None, -1),)),
     ("2,", (2,)), (" +1 : 9 : 3 ", (slice(1, 9, 3),))],
)
def test_parse_index(text: str, index: tuple) -> None:
    assert V.parse_index(text) == index


@pytest.mark.parametrize("text", ["a", "1.5", "1:2:3:4", "..., ...", "1,,2", "::0", "__import__('os')", "None", "[1]]"])
def test_parse_index_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="bad selection"):
        V.parse_index(text)


def test_selection_out_of_bounds(ck: ucp_zarr.Checkpoint) -> None:
    with pytest.raises(IndexError, match="out of bounds"):
        V.selection_shape((37, 29), (37,))
    with pytest.raises(IndexError, match="too many"):
        V.selection_shape((37,), (1, 2))
    with pytest.raises(IndexError, match="out of bounds"):
        ck.select_numpy("model.w", (0, -30))


# --- statistics -------------------------------------------------------------------------------


def _stats_reference(values: np.ndarray) -> dict:
    v = values.reshape(-1)
    if v.dtype.kind == "c":
        nan = np.isnan(v)
        inf = np.isinf(v) & ~nan
        finite = np.abs(v[~(nan | inf)].astype(np.complex128))  # moduli in float64, as documented
        lo_hi = finite
    else:
        nan = np.isnan(v) if v.dtype.kind == "f" else np.zeros(v.shape, bool)
        inf = np.isinf(v) if v.dtype.kind == "f" else np.zeros(v.shape, bool)
        lo_hi = v[~(nan | inf)]
        if lo_hi.dtype == np.bool_:
            lo_hi = lo_hi.astype(np.uint8)
        finite = lo_hi.astype(np.float64)
    return {
        "count": v.size, "nan": int(nan.sum()), "inf": int(inf.sum()),
        "min": lo_hi.min().item() if lo_hi.size else None, "max": lo_hi.max().item() if lo_hi.size else None,
        "mean": finite.mean() if finite.size else None, "std": finite.std() if finite.size else None,
        "norm": math.sqrt(float(np.sum(finite * finite))),
    }


@pytest.mark.parametrize("max_bytes", [64, 1 << 20])
def test_stats_match_numpy(ck: ucp_zarr.Checkpoint, max_bytes: int) -> None:
    state = _state()["model"]
    for name, t in state.items():
        s = I.tensor_stats(ck, f"model.{name}", max_bytes=max_bytes)
        want = _stats_reference(_reference(t))
        assert (s.count, s.nan, s.inf) == (want["count"], want["nan"], want["inf"]), name
        assert s.min == want["min"] and s.max == want["max"], name  # exact, ints as ints
        assert type(s.min) is type(want["min"]), name
        for f in ("mean", "std", "norm"):
            got, ref = getattr(s, f), want[f]
            assert (got is None) == (ref is None), (name, f)
            if ref is not None:
                assert got == pytest.approx(ref, rel=1e-9, abs=1e-12), (name, f)
        assert s.shape == tuple(t.shape) and s.dtype == str(t.dtype).removeprefix("torch.")
        assert json.loads(json.dumps(s.to_dict(), allow_nan=False))["count"] == s.count


def test_stats_details(ck: ucp_zarr.Checkpoint) -> None:
    s = ck["model.w"].stats()
    assert (s.nan, s.inf, s.finite) == (2, 2, 37 * 29 - 4)
    assert ck["model.i64"].stats().max == int(_state()["model"]["i64"].max())  # exact beyond 2**53
    e = I.tensor_stats(ck, "model.empty")
    assert (e.count, e.min, e.mean, e.std, e.norm) == (0, None, None, None, 0.0)
    n = I.tensor_stats(ck, "model.nans")
    assert (n.count, n.nan, n.min, n.mean) == (6, 6, None, None)
    path = ck.store.url + "_complex"
    ucp_zarr.save({"z": torch.tensor([complex(float("nan"), 1), complex(2, float("inf"))])}, path)
    z = I.tensor_stats(ucp_zarr.open(path), "z")
    assert (z.count, z.nan, z.inf, z.min, z.max, z.norm) == (2, 1, 1, None, None, 0.0)
    done = []
    I.tensor_stats(ck, "model.w", max_bytes=100, progress=lambda d, t: done.append((d, t)))
    assert len(done) > 3 and done[-1] == (37 * 29 * 4, 37 * 29 * 4)
    # a large mean and a tiny spread: no cancellation (shifted sums)
    path = ck.store.url + "_offset"
    x = 1e4 + torch.arange(1000, dtype=torch.float64) * 1e-6
    ucp_zarr.save({"x": x}, path, **SMALL)
    s = I.tensor_stats(ucp_zarr.open(path), "x", max_bytes=64)
    assert s.std == pytest.approx(x.numpy().std(), rel=1e-7)


# --- listings ---------------------------------------------------------------------------------


def test_list_tensors(ck: ucp_zarr.Checkpoint) -> None:
    rows = I.list_tensors(ck)
    assert [r.key for r in rows] == ck.keys()
    w = next(r for r in rows if r.key == "model.w")
    meta = ck.array_meta("model.w")
    assert (w.shape, w.dtype, w.nbytes, w.chunks, w.shard_shape) == ((37, 29), "float32", 37 * 29 * 4,
                                                                     meta.grid.chunk_shape, meta.grid.shard_shape)
    assert w.shards == math.prod(meta.grid.shard_counts) > 1 and w.path == ck.array_path("model.w")
    assert [r.key for r in I.list_tensors(ck, "model.[wc]")] == ["model.w", "model.c"]
    assert [r.key for r in I.list_tensors(ck, "*.h")] == ["model.h"]
    assert len(I.list_tensors(ck, "model")) == len(ck)  # a plain name selects its subtree
    assert I.list_tensors(ck, "mod") == []  # ...not a prefix of a name
    assert json.dumps([r.to_dict() for r in rows])


def test_checkpoint_info(ck: ucp_zarr.Checkpoint) -> None:
    info = json.loads(json.dumps(I.checkpoint_info(ck), allow_nan=False))
    assert (info["step"], info["tensors"], info["nbytes"]) == (7, len(ck), ck.nbytes())
    assert info["values"]["lr"] == 0.5 and info["index"]["model.w"]["shape"] == [37, 29]


# --- diff -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def variants(tmp_path_factory, ck_path: Path) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("variants")
    out = {"same": base / "same"}
    ucp_zarr.save(_state(), out["same"], chunk_bytes=1 << 11, shard_bytes=1 << 14)  # same values, other chunking
    s = _state()
    s["model"]["w"][2, 3] += 0.25  # one value
    s["model"]["bf"] = s["model"]["bf"].clone()
    s["model"]["bf"][0, :3] = torch.tensor([float("nan"), 1e30, -1e30]).bfloat16()
    s["model"]["h"] = s["model"]["h"].float()  # dtype change, same values
    s["model"]["u8"] = torch.zeros(51, dtype=torch.uint8)  # shape change
    del s["model"]["c"]
    s["model"]["extra"] = torch.ones(2)
    s["step"], s["note"] = 8, "x"
    del s["lr"]
    out["changed"] = base / "changed"
    ucp_zarr.save(s, out["changed"], **SMALL)
    return out


def test_diff_equal(ck_path: Path, variants: dict[str, Path]) -> None:
    d = D.diff(ck_path, variants["same"], max_bytes=256)
    assert d.equal and not d.values and {r.status for r in d.rows} == {"equal"}
    assert len(d.rows) == len(ucp_zarr.open(ck_path))
    assert all(r.ndiff == 0 and r.max_abs == 0.0 for r in d.rows)
    assert ucp_zarr.diff(ucp_zarr.open(ck_path), ucp_zarr.open(ck_path)).equal  # the package's lazy export


def test_diff_changes(ck_path: Path, variants: dict[str, Path]) -> None:
    state, changed = _state()["model"], ucp_zarr.open(variants["changed"])
    d = D.diff(ck_path, variants["changed"], max_bytes=256)
    rows = {r.key: r for r in d.rows}
    assert not d.equal
    w = rows["model.w"]
    assert (w.status, w.ndiff, w.nan_mismatch) == ("differs", 1, 0)
    b_abs = np.abs(changed.read("model.w").numpy())
    assert w.max_abs == pytest.approx(0.25, rel=1e-6)
    assert w.max_rel == pytest.approx(w.max_abs / b_abs[np.isfinite(b_abs)].max())
    bf = rows["model.bf"]
    assert (bf.status, bf.ndiff, bf.nan_mismatch) == ("differs", 3, 1)
    old = state["bf"][0, 1:3].float().abs()
    assert bf.max_abs == pytest.approx(float((torch.tensor(1e30).bfloat16().float() + old.max()).item()), rel=1e-2)
    h = rows["model.h"]
    assert (h.status, h.dtype_a, h.dtype_b, h.ndiff, h.max_abs) == ("dtype", "float16", "float32", 0, 0.0)
    u8 = rows["model.u8"]
    assert (u8.status, u8.shape_a, u8.shape_b, u8.max_abs) == ("shape", (50,), (51,), None)
    assert (rows["model.c"].status, rows["model.c"].shape_b) == ("only_a", None)
    assert (rows["model.extra"].status, rows["model.extra"].shape_b) == ("only_b", (2,))
    for key in ("model.i64", "model.flag", "model.scalar", "model.empty", "model.nans"):
        assert rows[key].status == "equal", key  # NaNs with the same bits are equal
    assert {(v.key, v.status, v.a, v.b) for v in d.values} == {
        ("step", "differs", 7, 8), ("lr", "only_a", 0.5, None), ("note", "only_b", None, "x")}
    assert d.counts() == {"equal": 6, "differs": 2, "only_a": 1, "only_b": 1, "shape": 1, "dtype": 1}
    out = json.loads(json.dumps(d.to_dict(), allow_nan=False))
    assert out["equal"] is False and len(out["rows"]) == len(d.rows)
    assert "<" in d._repr_html_() and "CheckpointDiff" in repr(d)
    # keys: only those compared; progress reported
    seen = []
    d2 = D.diff(ck_path, variants["changed"], keys=["model.w", "model.[uz]*", "step"], progress=lambda a, b: seen.append((a, b)))
    assert [r.key for r in D.diff(ck_path, variants["changed"], keys="model.w").rows] == ["model.w"]
    assert [r.key for r in d2.rows] == ["model.w", "model.u8"] and [v.key for v in d2.values] == ["step"]
    assert seen and seen[-1][0] == seen[-1][1]


def test_diff_relative_to_largest_b(tmp_path: Path) -> None:
    a = torch.tensor([1000.0, 1e-6, 0.0, float("inf"), 5.0])
    b = torch.tensor([1000.5, 2e-6, 0.0, 3.0, 5.0])
    ucp_zarr.save({"x": a, "z": torch.zeros(3)}, tmp_path / "a")
    ucp_zarr.save({"x": b, "z": torch.tensor([0.0, 1.0, 0.0]) * 0 + torch.tensor([0.0, 0.0, 2.0])}, tmp_path / "b")
    d = D.diff(tmp_path / "a", tmp_path / "b")
    x = next(r for r in d.rows if r.key == "x")
    assert x.ndiff == 3 and x.max_abs == float("inf")  # an Inf meets a finite value
    ucp_zarr.save({"x": a[:3], "z": torch.zeros(3)}, tmp_path / "a2")
    ucp_zarr.save({"x": b[:3], "z": torch.zeros(3)}, tmp_path / "b2")
    x = D.diff(tmp_path / "a2", tmp_path / "b2").rows[0]
    assert x.max_abs == pytest.approx(0.5) and x.max_rel == pytest.approx(0.5 / 1000.5)  # not 1e-6 / 2e-6
    z = next(r for r in d.rows if r.key == "z")
    assert (z.max_abs, z.max_rel) == (2.0, 1.0)
    ucp_zarr.save({"z": torch.ones(3)}, tmp_path / "c")
    ucp_zarr.save({"z": torch.zeros(3)}, tmp_path / "d")
    z = D.diff(tmp_path / "c", tmp_path / "d").rows[0]
    assert (z.max_abs, z.max_rel) == (1.0, math.inf) and z.to_dict()["max_rel"] == "inf"


def test_diff_per_rank_state(tmp_path: Path) -> None:
    ucp_zarr.save({"rng": ucp_zarr.PerRank(torch.arange(4)), "x": torch.ones(2)}, tmp_path / "a")
    ucp_zarr.save({"rng": ucp_zarr.PerRank(torch.arange(4) * 2), "x": torch.ones(2)}, tmp_path / "b")
    d = D.diff(tmp_path / "a", tmp_path / "b")
    rng = next(r for r in d.rows if r.key == "rng")
    assert (rng.status, rng.rank, rng.ndiff, rng.max_abs) == ("differs", 0, 3, 3.0)


def _save_rng_per_rank(rank: int, world: int, path: str) -> None:
    ucp_zarr.save({"rng": ucp_zarr.PerRank(torch.full((4,), float(rank))), "x": torch.ones(2)}, path)


def test_diff_of_per_rank_state_against_a_plain_tensor_compares_every_copy(tmp_path: Path) -> None:
    """Per-rank state on one side, a plain tensor on the other: each rank's copy is compared
    (before: only the lowest rank's, so rank 1's ones against zeros showed "equal")."""
    from _dist import run

    run(2, _save_rng_per_rank, str(tmp_path / "a"), timeout_s=60)
    ucp_zarr.save({"rng": torch.zeros(4), "x": torch.ones(2)}, tmp_path / "b")
    for a, b in (("a", "b"), ("b", "a")):
        rows = [(r.rank, r.status) for r in D.diff(tmp_path / a, tmp_path / b).rows if r.key == "rng"]
        assert rows == [(0, "equal"), (1, "differs")], (a, rows)


def test_diff_resolves_ties_and_tells_numbers_of_other_types_apart(tmp_path: Path) -> None:
    """A tied tensor is compared under each of its keys, whichever key stores it (before: the
    alias was "only_b" against an untied copy, and a tie stored under the other key showed
    both keys as only on one side); a value compares JSON type for type at every depth
    ([1, 2] and [1.0, 2.0] differ, as they load differently)."""
    w = torch.arange(6.0).reshape(2, 3)
    ucp_zarr.save({"wte": w, "lm_head": w, "v": [1, 2]}, tmp_path / "tied")  # (lm_head: an alias of wte)
    ucp_zarr.save({"lm_head": w, "wte": w, "v": [1, 2]}, tmp_path / "tied_other_way")
    ucp_zarr.save({"wte": w.clone(), "lm_head": w.clone(), "v": [1.0, 2.0]}, tmp_path / "untied")
    assert ucp_zarr.open(tmp_path / "tied").ties == {"lm_head": "wte"}
    assert D.diff(tmp_path / "tied", tmp_path / "tied_other_way").equal
    d = D.diff(tmp_path / "tied", tmp_path / "untied")
    assert [(r.key, r.status) for r in d.rows] == [("wte", "equal"), ("lm_head", "equal")]
    assert [(v.key, v.status) for v in d.values] == [("v", "differs")]
    ucp_zarr.save({"wte": w, "lm_head": w + 1}, tmp_path / "changed")
    rows = {r.key: r.status for r in D.diff(tmp_path / "tied", tmp_path / "changed").rows}
    assert rows == {"wte": "equal", "lm_head": "differs"}


# --- the package ------------------------------------------------------------------------------


def test_lazy_package_names() -> None:
    for name in ucp_zarr.__all__:
        assert getattr(ucp_zarr, name) is not None, name
    importlib.import_module("ucp_zarr.converters.base")  # binds the subpackage ucp_zarr.converters, another name

    assert callable(ucp_zarr.convert) and ucp_zarr.convert.__name__ == "convert"
    assert ucp_zarr.diff is D.diff and "diff" in dir(ucp_zarr)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ucp_zarr.nope  # noqa: B018


def test_empty_selections_are_ordinary_tensors(ck: ucp_zarr.Checkpoint) -> None:
    for t in (ck["model.empty"][...], ck["model.empty"][1:, ::2], ck["model.w"][5:5], ck["model.bf"][:, 30:]):
        assert t.numel() == 0 and t.stride() == torch.empty(t.shape).stride()
        assert t.contiguous().reshape(-1).view(torch.uint8).numel() == 0  # (a zero stride refuses this view)


def test_a_per_rank_checkpoint_has_one_size_everywhere(tmp_path: Path) -> None:
    """Every face counts each rank's copy of per-rank state, as ``list_steps`` and the stored
    bytes do (before: ``info``, the repr and the summary said 16 + 8 bytes where 2 ranks
    stored 16 x 2 + 8)."""
    from _dist import run

    from ucp_zarr.ops.steps import list_steps, step_name

    run(2, _save_rng_per_rank, str(tmp_path / step_name(1)), timeout_s=60)
    ck = ucp_zarr.open(tmp_path / step_name(1))
    stored = 2 * 16 + 8
    assert ck.nbytes() == stored and I.checkpoint_info(ck)["nbytes"] == stored
    assert [s.nbytes for s in list_steps(tmp_path)] == [stored]
    assert "40 B" in repr(ck)
    # the listing and the summary too (they counted one copy: 24 B)
    assert sum(r.nbytes for r in I.list_tensors(ck)) == stored
    assert I.checkpoint_summary(ck).total.nbytes == stored


def test_summary_puts_numbered_optimizer_state_under_its_number(tmp_path: Path) -> None:
    """Optimizer state saved without parameter names counts under its number (as
    docs/notebooks.md says), not at the top level with the top-level buffers."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ucp_zarr.save({"m": model.state_dict(), "opt": opt.state_dict(), "scale": torch.ones(2)}, tmp_path / "ck")
    rows = {r.name: r for r in I.checkpoint_summary(ucp_zarr.open(tmp_path / "ck")).modules}
    assert rows["0"].optimizer == 2 * 6 + 1 and rows["1"].optimizer == 2 * 2 + 1
    assert rows[""].optimizer == 0 and rows[""].tensors == 1


def test_diff_of_large_integers_is_exact(tmp_path: Path) -> None:
    """Integers that differ beyond 2**53 (int64 counters, seeds) differ by what torch says
    (before: both sides became float64 and max_abs was 0.0, rel_update "nothing changed")."""
    a = torch.tensor([2**62, 7, -(2**63)], dtype=torch.int64)
    b = torch.tensor([2**62 + 1, 7, 2**63 - 1], dtype=torch.int64)
    ucp_zarr.save({"n": a, "m": a[:2].clone()}, tmp_path / "a")
    ucp_zarr.save({"n": b, "m": b[:2].clone()}, tmp_path / "b")
    rows = {r.key: r for r in D.diff(tmp_path / "a", tmp_path / "b").rows}
    assert (rows["m"].ndiff, rows["m"].max_abs) == (1, float((b[:2] - a[:2]).abs().max()))
    assert (rows["n"].ndiff, rows["n"].max_abs) == (2, float(2**64 - 1)) and rows["n"].status == "differs"


def test_std_of_large_finite_values(tmp_path: Path) -> None:
    """The first block's cross term is zero, not ``inf * 0``: float64 values above ~1.3e154
    gave a NaN std (torch and numpy: 0)."""
    t = torch.tensor([1e200, 1e200, 1e200], dtype=torch.float64)
    ucp_zarr.save({"c": t, "one": torch.tensor([2e160], dtype=torch.float64)}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck["c"].stats().std == 0.0 and ck["one"].stats().std == 0.0
    assert ck["c"].stats().mean == 1e200


def test_complex64_moduli_in_float64(tmp_path: Path) -> None:
    """Statistics of complex64 take moduli in float64, as documented (numpy's abs of
    complex64 is float32), in ``stats`` and in a diff's norm."""
    t = torch.tensor([1 + 1j, 3 + 0.001j], dtype=torch.complex64)
    ucp_zarr.save({"z": t}, tmp_path / "a")
    ucp_zarr.save({"z": t * 2}, tmp_path / "b")
    moduli = np.abs(t.numpy().astype(np.complex128))
    s = ucp_zarr.open(tmp_path / "a")["z"].stats()
    assert (s.min, s.max, s.norm) == (moduli.min(), moduli.max(), float(np.sqrt(np.square(moduli).sum())))
    row = D.diff(tmp_path / "a", tmp_path / "b").rows[0]
    assert row.norm_a == float(np.sqrt(np.square(moduli).sum()))


def test_diff_across_integer_dtypes_is_exact(tmp_path: Path) -> None:
    """int64 against uint64 beyond 2**53: numpy compares them through float64, where 2**60
    and 2**60 + 1 are one number; the diff counts them apart."""
    ucp_zarr.save({"n": torch.tensor([2**60, 7, -1], dtype=torch.int64)}, tmp_path / "a")
    ucp_zarr.save({"n": torch.tensor([2**60 + 1, 7, 2**64 - 1], dtype=torch.uint64)}, tmp_path / "b")
    row = D.diff(tmp_path / "a", tmp_path / "b").rows[0]
    assert row.status == "dtype" and row.ndiff == 2 and row.max_abs == float(2**64)


def test_two_ellipses_refused_as_numpy_refuses(ck: ucp_zarr.Checkpoint) -> None:
    key = next(iter(ck.keys()))
    with pytest.raises(IndexError, match="single ellipsis"):
        ck[key][..., ...]


def test_plot_legends_keep_keys_starting_with_underscore() -> None:
    """torch.compile's ``_orig_mod.`` keys: matplotlib drops a found label starting with '_'."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from ucp_zarr.browse.plots import _new_axes, _plot_by_layer, plot_series
    from ucp_zarr.browse.runs import StepSeries

    s = StepSeries("/x", "norm", (1, 2), {"_orig_mod.fc.weight": (1.0, 2.0), "model.fc.weight": (1.5, 2.5)})
    ax = plot_series(s)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(s.values)
    ax = _new_axes(None)
    _plot_by_layer(ax, {"_orig_mod.layers.0.w": 1.0, "_orig_mod.layers.1.w": 2.0, "model.layers.0.w": 1.0}, "n", False)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["_orig_mod.layers.*.w", "model.layers.*.w"]
