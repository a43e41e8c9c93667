"""Resume the way torch users do: ``load`` fills the optimizer state a fresh optimizer lacks,
keyed as the target keys it, in its parameter's layout; ``read_state_dict`` gives back the
whole state dict as saved. Before, a fresh optimizer's state dict raised ``KeyMismatchError``
listing every ``optim.state.N.*`` key (and ``strict=False`` skipped them silently)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _states import record_text

import ucp_zarr
from _dist import run

HERE = Path(__file__).parent


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def test_a_fresh_process_resumes_bit_exactly(tmp_path):
    """This process trains 4 steps, saves {"model": model.state_dict(), "<opt>": opt.state_dict()}
    and trains 4 more; a fresh process builds model and optimizers (AdamW, SGD with Nesterov
    momentum, Adam with amsgrad over named parameters), loads, calls opt.load_state_dict and
    continues: every loss equals the uninterrupted run's, bit for bit."""
    from _resume_job import main

    main("train", str(tmp_path / "ck"), str(tmp_path / "a.json"), 4)
    job = [sys.executable, str(HERE / "_resume_job.py"), "resume", str(tmp_path / "ck"), str(tmp_path / "b.json"), "4"]
    subprocess.run(job, check=True)
    uninterrupted, resumed = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert len(resumed) == 4 and resumed == uninterrupted


def _trained(named: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.named_parameters() if named else model.parameters(), lr=0.1)
    for i in range(3):
        opt.zero_grad()
        model(torch.full((2, 3), float(i))).square().sum().backward()
        opt.step()
    return model, opt


def _fresh(named: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.named_parameters() if named else model.parameters(), lr=0.5)


def _assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for pid in want:
        assert list(got[pid]) == list(want[pid])
        for name, value in want[pid].items():
            assert _bits_equal(got[pid][name], value), (pid, name)


def test_fresh_optimizer_state_is_filled_strictly_and_not_reported(tmp_path):
    model, opt = _trained()
    ucp_zarr.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")
    model2, opt2 = _fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, keys = ucp_zarr.load(
            {"model": model2.state_dict(), "optim": opt2.state_dict()}, tmp_path / "ck", return_incompatible_keys=True
        )
    assert keys == ucp_zarr.IncompatibleKeys([], [])  # filled, so neither missing nor unexpected
    _assert_same_state(state["optim"]["state"], opt.state_dict()["state"])
    assert list(state["optim"]["state"]) == [0, 1, 2, 3]  # keyed as the target keys it
    opt2.load_state_dict(state["optim"])
    assert opt2.param_groups[0]["lr"] == 0.1
    _assert_same_state(opt2.state_dict()["state"], opt.state_dict()["state"])
    # without strict, only what the target has no place for is reported
    _, keys = ucp_zarr.load({"optim": _fresh()[1].state_dict()}, tmp_path / "ck", strict=False, return_incompatible_keys=True)
    assert keys.missing_keys == [] and keys.unexpected_keys == ["model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"]


def test_state_saved_by_fqn_fills_a_numbered_target_and_the_reverse(tmp_path):
    """get_state_dict keys optimizer state by parameter name, opt.state_dict() by number:
    each loads into the other, matched by position in the param groups (as
    Optimizer.load_state_dict matches them), keyed the target's way."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    assert list(osd["state"]) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    ucp_zarr.save({"model": msd, "optim": osd}, tmp_path / "by_name")
    model2, opt2 = _fresh()
    state = ucp_zarr.load({"model": model2.state_dict(), "optim": opt2.state_dict()}, tmp_path / "by_name")
    assert list(state["optim"]["state"]) == [0, 1, 2, 3] and state["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    _assert_same_state(state["optim"]["state"], opt.state_dict()["state"])
    opt2.load_state_dict(state["optim"])

    ucp_zarr.save({"optim": opt.state_dict()}, tmp_path / "by_number")
    target = {"optim": {"state": {}, "param_groups": [dict(osd["param_groups"][0], lr=0.0)]}}
    ucp_zarr.load(target, tmp_path / "by_number")
    assert list(target["optim"]["state"]) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert target["optim"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    _assert_same_state(target["optim"]["state"], osd["state"])


def _two(order: str) -> tuple[torch.nn.ModuleDict, torch.optim.Optimizer, torch.optim.Optimizer]:
    """Layers ``a`` and ``b`` (other shapes: a swap would not even fit), and two Adams over
    them listing the parameters in ``order``: one by name, one by number with names."""
    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 3), "b": torch.nn.Linear(3, 2)})
    named = [(f"{k}.{n}", p) for k in order for n, p in m[k].named_parameters()]
    return m, torch.optim.Adam([p for _, p in named], lr=0.1), torch.optim.Adam(named, lr=0.1)


def _steps(m: torch.nn.ModuleDict, opts: list[torch.optim.Optimizer], steps: range) -> None:
    for i in steps:
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(i))
        for o in opts:
            o.zero_grad()
        (m["a"](x).pow(2).sum() + 3 * m["b"](x).sum()).backward()
        for o in opts:
            o.step()


def test_optimizer_state_keyed_by_name_is_matched_by_name_whatever_the_order(tmp_path):
    """State saved with its parameters in one order loads into an optimizer that lists them
    in another, each parameter getting its own state: keyed by name (``get_state_dict``: as
    DCP's ``dcp.load`` + ``set_state_dict`` match it, the reference run here), or by number
    with ``param_names`` on both sides. Training then goes on bit for bit as the
    uninterrupted run. Before, both were matched by position: each parameter got another's
    Adam moments, silently where the shapes agree."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    m, by_fqn, _ = _two("ab")
    _steps(m, [by_fqn], range(3))
    msd, osd = get_state_dict(m, by_fqn)
    ucp_zarr.save({"model": msd, "optim": osd}, tmp_path / "fqn")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    resumed = []
    for how in ("dcp", "ucp"):
        m2, o2, _ = _two("ba")
        state = dict(zip(("model", "optim"), get_state_dict(m2, o2)))
        if how == "dcp":
            dcp.load(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
        else:
            ucp_zarr.load(state, tmp_path / "fqn")
        set_state_dict(m2, o2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert _bits_equal(o2.state[m2["a"].weight]["exp_avg"], by_fqn.state[m["a"].weight]["exp_avg"])
        resumed.append((m2, o2))
    _steps(m, [by_fqn], range(3, 5))
    for m2, o2 in resumed:
        _steps(m2, [o2], range(3, 5))
        assert all(_bits_equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))

    m, _, numbered = _two("ab")
    _steps(m, [numbered], range(3))
    ucp_zarr.save({"optim": numbered.state_dict()}, tmp_path / "numbered")
    m2, _, numbered2 = _two("ba")
    m2.load_state_dict(m.state_dict())
    state = ucp_zarr.load({"optim": numbered2.state_dict()}, tmp_path / "numbered")
    numbered2.load_state_dict(state["optim"])
    assert _bits_equal(numbered2.state[m2["a"].weight]["exp_avg_sq"], numbered.state[m["a"].weight]["exp_avg_sq"])
    _steps(m, [numbered], range(3, 5))
    _steps(m2, [numbered2], range(3, 5))
    assert all(_bits_equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


def test_param_names_on_one_side_only_are_neither_missing_nor_unexpected(tmp_path):
    """State saved by ``get_state_dict`` (no ``param_names``) loads strictly into an optimizer
    built from ``model.named_parameters()`` (the README's advice), and state saved with
    ``param_names`` into one built from ``model.parameters()``, as ``Optimizer.load_state_dict``
    takes either: each parameter gets its own state. Before: ``KeyMismatchError`` naming
    ``optim.param_groups.0.param_names`` as missing (or unexpected)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _trained()
    ucp_zarr.save({"optim": get_state_dict(model, opt)[1]}, tmp_path / "fqn")
    named = torch.optim.AdamW(model.named_parameters())
    state = ucp_zarr.load({"optim": named.state_dict()}, tmp_path / "fqn")
    assert state["optim"]["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]
    named.load_state_dict(state["optim"])
    _assert_same_state(named.state_dict()["state"], opt.state_dict()["state"])
    ucp_zarr.save({"optim": named.state_dict()}, tmp_path / "named")
    plain = torch.optim.AdamW(model.parameters())
    plain.load_state_dict(ucp_zarr.load({"optim": plain.state_dict()}, tmp_path / "named")["optim"])
    _assert_same_state(plain.state_dict()["state"], opt.state_dict()["state"])


def _without_nesting(ck: Path) -> None:
    """The checkpoint ``ck`` as an older ucp_zarr wrote it: no recorded nesting."""
    root = ck / "zarr.json"
    doc = json.loads(root.read_text())
    del doc["attributes"]["ucp_zarr"]["structure"]
    root.write_text(record_text(doc))
    assert ucp_zarr.open(ck).meta.structure is None


def test_a_checkpoint_without_recorded_nesting_fills_it_too(tmp_path):
    """A checkpoint that records no nesting (an older one): the state is matched through
    the param groups saved with it."""
    model, opt = _trained(named=True)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "state.pt")
    ucp_zarr.convert(tmp_path / "state.pt", tmp_path / "ck")
    _without_nesting(tmp_path / "ck")
    model2, opt2 = _fresh(named=True)
    state = ucp_zarr.load({"model": model2.state_dict(), "optim": opt2.state_dict()}, tmp_path / "ck")
    _assert_same_state(state["optim"]["state"], opt.state_dict()["state"])


def test_partly_absent_and_nested_entries(tmp_path):
    """Any nested entry the target lacks below a parameter's state, and what an empty mapping
    of the target held, are filled; keys under no such place stay unexpected."""
    w = torch.randn(3)
    saved = {
        "o": {"state": {0: {"m": torch.ones(3), "deep": {"a": torch.arange(3), "k": (1, 2)}, "n": 5}},
              "param_groups": [{"params": [0], "lr": 0.1}]},
        "extra": {"x": w, "y": {1: "one"}},
        "other": torch.zeros(2),
    }
    ucp_zarr.save(saved, tmp_path / "ck")
    target = {"o": {"state": {0: {"m": torch.zeros(3)}}, "param_groups": [{"params": [0], "lr": 0.0}]}, "extra": {}}
    with pytest.warns(ucp_zarr.IncompatibleKeysWarning) as caught:
        ucp_zarr.load(target, tmp_path / "ck", strict=False)
    assert caught[0].message.unexpected_keys == ["other"] and caught[0].message.missing_keys == []
    st = target["o"]["state"][0]
    assert torch.equal(st["m"], torch.ones(3)) and torch.equal(st["deep"]["a"], torch.arange(3))
    assert st["deep"]["k"] == (1, 2) and st["n"] == 5 and target["o"]["param_groups"][0]["lr"] == 0.1
    assert torch.equal(target["extra"]["x"], w) and target["extra"]["y"] == {1: "one"}


def test_a_refused_load_adds_nothing(tmp_path):
    model, opt = _trained()
    ucp_zarr.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")
    _, opt2 = _fresh()
    target = {"model": {"0.weight": torch.zeros(4, 3, dtype=torch.float16)}, "optim": opt2.state_dict()}
    with pytest.raises(ucp_zarr.DtypeMismatchError):
        ucp_zarr.load(target, tmp_path / "ck", strict=False)
    assert target["optim"]["state"] == {}


# --- read_state_dict ---------------------------------------------------------------------------


def _state() -> dict:
    model, opt = _trained()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 3,
        "sched": {"milestones": {2: 1, 5: 1}, "betas": (0.9, (0.99, 0.999)), "last": [1.5, float("inf")]},
        "blocks": [torch.ones(2, dtype=torch.bfloat16), {"w": torch.zeros(1, dtype=torch.int64), "empty": {}}, []],
        "rng": ucp_zarr.PerRank(torch.arange(4, dtype=torch.uint8)),
        "blob": b"\x00\x01",
        "none": None,
        "empty": {},
    }


def _assert_same(got, want, where="") -> None:
    if isinstance(want, ucp_zarr.PerRank):
        want = want.value
    assert type(got) is type(want) or isinstance(want, dict) and type(got) is dict, (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert _bits_equal(got, want), where
    elif isinstance(want, (dict, list, tuple)):
        assert len(got) == len(want), where
        items = want.items() if isinstance(want, dict) else enumerate(want)
        if isinstance(want, dict):
            assert list(got) == list(want), where
        for k, v in items:
            _assert_same(got[k], v, f"{where}.{k}")
    else:
        assert got == want, where


def test_read_state_dict_gives_back_what_torch_load_would(tmp_path):
    sd = _state()
    ucp_zarr.save(sd, tmp_path / "ck")
    buf = io.BytesIO()
    torch.save({k: v.value if isinstance(v, ucp_zarr.PerRank) else v for k, v in sd.items()}, buf)
    buf.seek(0)
    reference = torch.load(buf, weights_only=True)
    got = ucp_zarr.read_state_dict(tmp_path / "ck")
    _assert_same(got, reference)
    # the optimizer part goes straight into a fresh optimizer
    _, opt2 = _fresh()
    opt2.load_state_dict(got["optim"])
    _assert_same_state(opt2.state_dict()["state"], sd["optim"]["state"])


def test_read_state_dict_keys_and_device(tmp_path):
    sd = _state()
    ucp_zarr.save(sd, tmp_path / "ck")
    got = ucp_zarr.read_state_dict(tmp_path / "ck", keys=["optim.state", "step", "blocks.1"])
    assert list(got) == ["optim", "step", "blocks"] and list(got["optim"]) == ["state"]
    _assert_same(got["optim"]["state"], sd["optim"]["state"])
    assert got["blocks"][0] is None and list(got["blocks"][1]) == ["w", "empty"]
    with pytest.raises(ucp_zarr.KeyMismatchError, match="optim.stat\\b"):
        ucp_zarr.read_state_dict(tmp_path / "ck", keys=["optim.stat"])
    # an empty mapping (a fresh optimizer's state) is selected as the empty mapping it was
    # (before: KeyMismatchError, "missing from the checkpoint")
    fresh = {"optim": torch.optim.Adam(torch.nn.Linear(2, 2).parameters()).state_dict()}
    ucp_zarr.save(fresh, tmp_path / "fresh")
    assert ucp_zarr.read_state_dict(tmp_path / "fresh", keys=["optim.state"]) == {"optim": {"state": {}}}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    there = ucp_zarr.read_state_dict(tmp_path / "ck", keys="model", device=device)
    assert list(there) == ["model"] and there["model"]["0.weight"].device.type == device
    _assert_same(there["model"]["0.weight"].cpu(), sd["model"]["0.weight"])


def test_read_state_dict_of_a_checkpoint_without_recorded_nesting_is_flat(tmp_path):
    torch.save({"a": {"b": torch.ones(2)}, "n": 1}, tmp_path / "s.pt")
    ucp_zarr.convert(tmp_path / "s.pt", tmp_path / "ck")
    assert list(ucp_zarr.read_state_dict(tmp_path / "ck")) == ["a", "n"]  # (a conversion records it)
    _without_nesting(tmp_path / "ck")
    got = ucp_zarr.read_state_dict(tmp_path / "ck")
    assert list(got) == ["a.b", "n"] and torch.equal(got["a.b"], torch.ones(2)) and got["n"] == 1


def test_read_state_dict_of_a_dcp_save_matches_dcps_own_loader(tmp_path):
    """Saved through torch DCP (ZarrStorageWriter): nested as DCP's own loaders nest it
    (_load_state_dict with _EmptyStateDictLoadPlanner, what dcp_to_torch_save runs)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    sd = {"model": _trained()[0].state_dict(), "groups": [{"lr": 0.1, "w": torch.ones(2)}], "blob": io.BytesIO(b"xy")}
    _save_state_dict(sd, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "dcp"), no_dist=True)
    theirs: dict = {}
    _load_state_dict(theirs, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "dcp"),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    ours = ucp_zarr.read_state_dict(tmp_path / "dcp")
    assert ours["blob"].getvalue() == theirs["blob"].getvalue() == b"xy"
    ours.pop("blob"), theirs.pop("blob")
    _assert_same(ours, theirs)


def test_load_of_a_dcp_save_gives_back_bytesio_as_dcp_load_does(tmp_path):
    """A value saved through torch DCP as ``io.BytesIO`` replaces a ``load`` target's
    ``BytesIO`` by a ``BytesIO`` of its bytes, as ``dcp.load`` does (before: plain ``bytes``, which
    a loader calling ``.seek``/``.read`` on it, as ``torch.load`` of the blob does, fails on)."""
    import torch.distributed.checkpoint as dcp

    blob = io.BytesIO()
    torch.save({"rng": torch.get_rng_state()}, blob)
    dcp.save({"w": torch.ones(2), "blob": blob}, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "dcp"), no_dist=True)
    theirs, ours = ({"w": torch.zeros(2), "blob": io.BytesIO()} for _ in range(2))
    dcp.load(theirs, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "dcp"), no_dist=True)
    ucp_zarr.load(ours, tmp_path / "dcp")
    assert type(ours["blob"]) is type(theirs["blob"]) is io.BytesIO
    assert ours["blob"].getvalue() == theirs["blob"].getvalue() == blob.getvalue()


def test_a_tampered_structure_is_refused(tmp_path):
    """A path that spells another key, is not a path, or would make a rebuild allocate a
    billion list slots is refused when the checkpoint is opened."""
    ucp_zarr.save({"a": {"b": torch.ones(2)}, "x": {"1000000000": 1}}, tmp_path / "ck")
    root = tmp_path / "ck" / "zarr.json"
    good = root.read_text()
    for key, bad in (("a.b", ["a", "x"]), ("a.b", []), ("a.b", "a.b"), ("a.b", ["a", {"key": [1]}]),
                     ("x.1000000000", ["x", 10**9])):
        doc = json.loads(good)
        doc["attributes"]["ucp_zarr"]["structure"]["paths"][key] = bad
        root.write_text(record_text(doc))
        with pytest.raises(ucp_zarr.FormatError, match="structure"):
            ucp_zarr.open(tmp_path / "ck")


# --- distributed ---------------------------------------------------------------------------------


def _fsdp2_job(rank: int, world: int, root: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def build(seed: int, named: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        params = model.named_parameters() if named else model.parameters()
        return model, torch.optim.AdamW(params, lr=1e-2)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
        g = torch.Generator().manual_seed(100 * i + rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    model, opt = build(0, named=True)
    for i in range(3):
        step(model, opt, i)
    ucp_zarr.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{root}/ck")
    uninterrupted = [step(model, opt, i) for i in range(3, 6)]

    model2, opt2 = build(1, named=True)
    state = ucp_zarr.load({"model": model2.state_dict(), "optim": opt2.state_dict()}, f"{root}/ck")
    moment = state["optim"]["state"][0]["exp_avg"]
    weight = model2.state_dict()["0.weight"]
    assert isinstance(moment, DTensor) and moment.placements == weight.placements
    assert moment.to_local().shape == weight.to_local().shape and not isinstance(state["optim"]["state"][0]["step"], DTensor)
    opt2.load_state_dict(state["optim"])
    assert [step(model2, opt2, i) for i in range(3, 6)] == uninterrupted

    # the parameter of unnamed state cannot be told: the error names the key and the fix
    _, opt3 = build(2, named=False)
    try:
        ucp_zarr.load({"optim": opt3.state_dict()}, f"{root}/ck", strict=False)
    except ucp_zarr.LayoutError as e:
        assert "'optim.state.0.exp_avg'" in str(e) and "named_parameters()" in str(e), str(e)
    else:
        raise AssertionError("an absent DTensor moment whose parameter is unknown was made anyway")

    # Shard and FlatShard parameters: absent state is made like them
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    lo, hi = 3 * rank, 3 * rank + 3
    flat = w.reshape(-1)[12 * rank : 12 * rank + 12]
    groups = [{"params": ["w", "v"], "lr": 0.1}]
    saved = {
        "model": {"w": ucp_zarr.Shard(w[lo:hi].clone(), (6, 4), (lo, 0)), "v": ucp_zarr.FlatShard(flat.clone(), (6, 4), 12 * rank)},
        "optim": {"state": {"w": {"m": ucp_zarr.Shard(-w[lo:hi], (6, 4), (lo, 0))}, "v": {"m": ucp_zarr.FlatShard(-flat, (6, 4), 12 * rank)}},
                  "param_groups": groups},
    }
    ucp_zarr.save(saved, f"{root}/shards")
    # loaded on the two ranks the other way round
    other = 1 - rank
    olo, ohi = 3 * other, 3 * other + 3
    target = {
        "model": {"w": ucp_zarr.Shard(torch.zeros(3, 4), (6, 4), (olo, 0)), "v": ucp_zarr.FlatShard(torch.zeros(12), (6, 4), 12 * other)},
        "optim": {"state": {}, "param_groups": [dict(groups[0])]},
    }
    ucp_zarr.load(target, f"{root}/shards")
    m_w, m_v = target["optim"]["state"]["w"]["m"], target["optim"]["state"]["v"]["m"]
    assert isinstance(m_w, ucp_zarr.Shard) and m_w.global_offset == (olo, 0) and torch.equal(m_w.local, -w[olo:ohi])
    assert isinstance(m_v, ucp_zarr.FlatShard) and m_v.flat_offset == 12 * other
    assert torch.equal(m_v.local, -w.reshape(-1)[12 * other : 12 * other + 12])

    # a DTensor whose local tensor is a conjugate view is filled in place (it stayed zero)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(6, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    ucp_zarr.save({"c": distribute_tensor(full, mesh, [Shard(0)])}, f"{root}/complex")
    into = distribute_tensor(torch.zeros(6, 4, dtype=torch.complex64), mesh, [Shard(1)])
    ucp_zarr.load({"c": into.conj()}, f"{root}/complex")
    assert torch.equal(into.full_tensor(), full.conj())


def test_fsdp2_fresh_optimizer_resumes_bit_exactly_on_two_ranks(tmp_path):
    """2-process gloo FSDP2: the fresh optimizer's state is made as DTensors placed like their
    parameters, opt.load_state_dict takes it and the losses equal the uninterrupted run's;
    Shard / FlatShard parameters get Shard / FlatShard state; state whose parameter cannot be
    told is refused by name; a conjugate DTensor view is filled."""
    run(2, _fsdp2_job, str(tmp_path), timeout_s=120)


def _saved_named(path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two layers of 4 -> 4 (one shape: state of the wrong one would fit) and Adam over their
    named parameters, after one step, saved at ``path``."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    o = torch.optim.Adam(m.named_parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    ucp_zarr.save({"optim": o.state_dict()}, path)
    return m, o


def test_an_optimizer_of_some_of_the_saved_parameters_gets_their_state_by_name(tmp_path) -> None:
    """Both sides name every parameter (``named_parameters()``) but hold other sets: an
    optimizer of the top layer only, loaded with ``strict=False`` from the whole model's,
    got the moments of the saved parameter of its number (``0.weight``'s for ``1.weight``: the
    same shape, in place) and called nothing missing. Now matched by name, as DCP's
    ``set_state_dict`` matches: in place, into a fresh optimizer, and the other way round."""
    import warnings

    m, o = _saved_named(tmp_path / "all")
    saved = {n: o.state[p]["exp_avg"].clone() for n, p in m.named_parameters()}

    def top(stepped: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        o2 = torch.optim.Adam([(n, p) for n, p in m2.named_parameters() if n.startswith("1.")], lr=0.5)
        if stepped:
            m2(torch.randn(2, 4)).sum().backward()
            o2.step()
        return m2, o2

    for stepped in (True, False):
        m2, o2 = top(stepped)
        sd = {"optim": o2.state_dict()}
        _, keys = ucp_zarr.load(sd, tmp_path / "all", strict=False, return_incompatible_keys=True)
        o2.load_state_dict(sd["optim"])
        assert torch.equal(o2.state[m2[1].weight]["exp_avg"], saved["1.weight"])
        assert torch.equal(o2.state[m2[1].bias]["exp_avg"], saved["1.bias"])
        assert keys.missing_keys == [] and sorted(keys.unexpected_keys) == sorted(
            f"optim.state.{i}.{k}" for i in (0, 1) for k in ("step", "exp_avg", "exp_avg_sq"))
    m2, o2 = top(True)  # the other way round: the whole model's optimizer from the top layer's
    ucp_zarr.save({"optim": o2.state_dict()}, tmp_path / "top")
    mine = {n: o.state[p]["exp_avg"].clone() for n, p in m.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, keys = ucp_zarr.load({"optim": o.state_dict()}, tmp_path / "top", strict=False, return_incompatible_keys=True)
    assert torch.equal(o.state[m[1].weight]["exp_avg"], o2.state[m2[1].weight]["exp_avg"])
    assert torch.equal(o.state[m[0].weight]["exp_avg"], mine["0.weight"])  # (kept: nothing of its own was saved)
    assert sorted(keys.missing_keys) == sorted(f"optim.state.{i}.{k}" for i in (0, 1) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_an_optimizer_of_the_model_renamed_whole_is_matched_by_position(tmp_path) -> None:
    """The same model behind a wrapper (DDP's ``module.``): no name in common, so state is
    matched by position in the param groups, as ``Optimizer.load_state_dict`` matches it (the
    name matching of the test above refused every key here)."""
    m, opt = _saved_named(tmp_path / "ck")
    wrapped = torch.nn.Module()
    wrapped.module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt2 = torch.optim.Adam(wrapped.named_parameters(), lr=0.1)
    sd = {"optim": opt2.state_dict()}
    ucp_zarr.load(sd, tmp_path / "ck")
    opt2.load_state_dict(sd["optim"])
    for p, q in zip(m.parameters(), wrapped.parameters()):
        assert torch.equal(opt2.state[q]["exp_avg"], opt.state[p]["exp_avg"])
