"""Bit-exact round trips through save/load/open, for every dtype and real training state."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ucp_zarr
from ucp_zarr.format.dtypes import supported_dtypes


def _random(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bits of ``dtype`` (every bit pattern, NaNs and infs included)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, dtype=torch.bool)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    a, b = a.contiguous(), b.contiguous()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", supported_dtypes(), ids=str)
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype):
    sd = {
        "t": _random(dtype, (37, 19)),
        "big": _random(dtype, (300, 64)),  # several chunks and shards with chunk_bytes below
        "scalar": _random(dtype, ()),
        "empty": _random(dtype, (0, 5)),
        "strided": _random(dtype, (16, 12))[:, ::3],  # non-contiguous
        "transposed": _random(dtype, (10, 7)).t(),
    }
    ucp_zarr.save(sd, tmp_path / "ck", chunk_bytes=1024, shard_bytes=8192)
    out = {k: torch.zeros_like(v) if v.dtype != torch.bool else torch.zeros(v.shape, dtype=torch.bool) for k, v in sd.items()}
    ucp_zarr.load(out, tmp_path / "ck")
    for k in sd:
        assert _bits_equal(out[k], sd[k]), k
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck["big"].dtype == dtype and tuple(ck["big"].shape) == (300, 64)
    assert ck.array_meta("big").grid.sharded
    assert _bits_equal(ck["big"][...], sd["big"])
    assert _bits_equal(ck["scalar"][()], sd["scalar"])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(2))
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 50, bias=False)
        self.register_buffer("counter", torch.arange(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(self.norm(h))


def _trained(steps: int = 3, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Net().to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(steps):
        x = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(i))
        loss = model(x).float().logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_and_adam_state_dict_round_trip(tmp_path, dtype):
    model, opt = _trained(dtype=dtype)
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3, "sched": {"last_epoch": 3, "lrs": [0.01]}}
    ucp_zarr.save(sd, tmp_path / "ck")

    model2, opt2 = _trained(steps=1, dtype=dtype)  # other values, same structure
    target = {"model": model2.state_dict(), "optim": opt2.state_dict(), "step": 0, "sched": {"last_epoch": 0, "lrs": [1.0]}}
    ucp_zarr.load(target, tmp_path / "ck")
    opt2.load_state_dict(target["optim"])
    for k, v in model.state_dict().items():
        assert _bits_equal(model2.state_dict()[k], v), k
    for pid, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            assert _bits_equal(opt2.state_dict()["state"][pid][name], v), (pid, name)
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert target["step"] == 3 and target["sched"] == {"last_epoch": 3, "lrs": [0.01]}
    assert isinstance(target["optim"]["param_groups"][0]["betas"], tuple)


def test_get_state_dict_round_trip(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    ucp_zarr.save({"model": msd, "optim": osd}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert "model.layers.0.weight" in ck.keys()
    assert "optim.state.layers.0.weight.exp_avg" in ck.keys()
    # a parameter and its moments share a group
    assert ck.array_path("model.layers.0.weight").split("/")[0] == ck.array_path("optim.state.layers.0.weight.exp_avg_sq").split("/")[0]

    model2, opt2 = _trained(steps=1)
    msd2, osd2 = get_state_dict(model2, opt2)
    target = {"model": msd2, "optim": osd2}
    ucp_zarr.load(target, tmp_path / "ck")
    set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    for k, v in model.state_dict().items():
        assert _bits_equal(model2.state_dict()[k], v), k
    # training continues identically
    x = torch.randint(0, 50, (4, 6))
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).logsumexp(-1).mean().backward()
        o.step()
    for k, v in model.state_dict().items():
        assert _bits_equal(model2.state_dict()[k], v), k


def test_load_converts_into_the_target_dtype_and_keeps_it(tmp_path):
    w = torch.randn(8, 8)
    ucp_zarr.save({"w": w}, tmp_path / "ck")
    target = {"w": torch.zeros(8, 8, dtype=torch.float64)}
    ucp_zarr.load(target, tmp_path / "ck")
    assert target["w"].dtype == torch.float64 and torch.equal(target["w"], w.double())


def test_load_fills_existing_tensors_in_place(tmp_path):
    model, _ = _trained()
    ucp_zarr.save({"model": model.state_dict()}, tmp_path / "ck")
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    before = {n: p.data_ptr() for n, p in other.named_parameters()}
    ucp_zarr.load({"model": other.state_dict()}, tmp_path / "ck")
    assert before == {n: p.data_ptr() for n, p in other.named_parameters()}
    for (n, p), q in zip(other.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n


def test_metadata_and_reprs(tmp_path):
    model, opt = _trained()
    ucp_zarr.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 42, "lr": float("inf")}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    md = ck.metadata
    assert md["step"] == 42 and md["world_size"] == 1 and md["created"]
    assert md["values"]["lr"] == float("inf")
    assert md["values"]["optim.param_groups.0.lr"] == 1e-2
    assert "model.head.weight" in repr(ck) or "head.weight/" in repr(ck)
    assert "<details>" in ck._repr_html_()
    assert ck.verify() == sum(ck[k].numel() * ck[k].dtype.itemsize for k in ck.keys())


def test_module_state_dict_metadata_comes_back_as_torch_load_gives_it(tmp_path):
    """A module's ``state_dict()`` carries ``_metadata`` (each submodule's version), which
    ``load_state_dict`` passes to the modules: read_state_dict gives it back, at the top, under
    a key and in a list, as torch.load does, so a torch.ao observer keeps its saved ``eps``
    (before: a plain dict, and the observer took its old-checkpoint branch: eps 1.19e-07, not 1e-3)."""
    import io

    from torch.ao.quantization import MinMaxObserver

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), MinMaxObserver(eps=1e-3))

    model = make()
    model(torch.randn(3, 4))
    state = {"state_dict": model.state_dict(), "more": [model.state_dict()], "step": 3}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    ref = torch.load(buffer, weights_only=False)
    for name, saved in (("nested", state), ("top", model.state_dict())):
        ucp_zarr.save(saved, tmp_path / name)
        back = ucp_zarr.read_state_dict(tmp_path / name)
        for got, want in ((back["state_dict"], ref["state_dict"]), (back["more"][0], ref["more"][0])) if name == "nested" \
                else ((back, ref["state_dict"]),):
            assert got._metadata == want._metadata and list(got) == list(want)
            fresh = make()
            fresh[2].eps.fill_(1.0)
            fresh.load_state_dict(got)
            assert torch.equal(fresh[2].eps, model[2].eps) and fresh[2].eps.item() == pytest.approx(1e-3)
    # placed by rules (a Megatron-style save): the same (before: place() rebuilt plain dicts)
    rules = ucp_zarr.Rules(params=(ucp_zarr.rules.params.ParamRule("replicated", (r".*",)),))
    ucp_zarr.save(ucp_zarr.place({"model": model.state_dict()}, rules), tmp_path / "placed")
    assert ucp_zarr.read_state_dict(tmp_path / "placed")["model"]._metadata == ref["state_dict"]._metadata
