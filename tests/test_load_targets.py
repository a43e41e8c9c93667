"""Every kind of tensor a user may load into is filled exactly, or the load raises naming it.

Before the fix, a conjugate or negative view was resolved into a copy and the copy filled
(the target stayed zero, the load succeeded), an expanded view kept only the last row
written, and a meta-device destination of ``Checkpoint.read`` was "filled" with nothing."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

import ucp_zarr
from ucp_zarr import FlatShard, Shard


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _inference(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(shape, dtype=dtype)


# kind -> (dtype of the saved tensor, a zero target of shape (6, 4) viewing other memory)
TARGETS: dict[str, tuple[torch.dtype, Callable[[], torch.Tensor]]] = {
    "plain": (torch.float32, lambda: torch.zeros(6, 4)),
    "transposed": (torch.float32, lambda: torch.zeros(4, 6).t()),
    "strided": (torch.float32, lambda: torch.zeros(12, 8)[::2, 1::2]),
    "conj": (torch.complex64, lambda: torch.zeros(6, 4, dtype=torch.complex64).conj()),
    "conj-transposed": (torch.complex128, lambda: torch.zeros(4, 6, dtype=torch.complex128).conj().t()),
    "neg (conj().imag)": (torch.float32, lambda: torch.zeros(6, 4, dtype=torch.complex64).conj().imag),
    "real of conj": (torch.float32, lambda: torch.zeros(6, 4, dtype=torch.complex64).conj().real),
    "view of another dtype": (torch.int32, lambda: torch.zeros(6, 4).view(torch.int32)),
    "bfloat16 bits view": (torch.bfloat16, lambda: torch.zeros(6, 4, dtype=torch.int16).view(torch.bfloat16)),
    "requires_grad leaf": (torch.float32, lambda: torch.nn.Parameter(torch.zeros(6, 4))),
    "inference tensor": (torch.float32, lambda: _inference((6, 4), torch.float32)),
    "inference conj": (torch.complex64, lambda: _inference((6, 4), torch.complex64).conj()),
    "into float64": (torch.float32, lambda: torch.zeros(6, 4, dtype=torch.float64)),
    "into conj complex128": (torch.complex64, lambda: torch.zeros(6, 4, dtype=torch.complex128).conj()),
}
if torch.cuda.is_available():
    TARGETS["cuda conj"] = (torch.complex64, lambda: torch.zeros(6, 4, dtype=torch.complex64, device="cuda").conj())
    TARGETS["cuda strided"] = (torch.float32, lambda: torch.zeros(12, 8, device="cuda")[::2, ::2])


def _saved(dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_complex:
        return torch.randn(6, 4, dtype=dtype)
    if dtype == torch.int32:
        return torch.randint(-(2**31), 2**31 - 1, (6, 4), dtype=torch.int32)
    return torch.randn(6, 4).to(dtype)


@pytest.mark.parametrize("kind", list(TARGETS))
def test_every_view_is_filled_exactly(tmp_path, kind):
    dtype, make = TARGETS[kind]
    saved = _saved(dtype)
    ucp_zarr.save({"t": saved}, tmp_path / "ck")
    target = make()
    assert not target.any()
    ucp_zarr.load({"t": target}, tmp_path / "ck")
    assert _same(target, saved.to(target.dtype)), kind
    # the same through Checkpoint.read, into a box of the tensor
    again = make()
    ucp_zarr.open(tmp_path / "ck").read("t", ucp_zarr.layout.Box((2, 1), (3, 2)), out=again[2:5, 1:3])
    assert _same(again[2:5, 1:3], saved[2:5, 1:3].to(again.dtype)) and not again[:2].any(), kind


def test_the_issue_example(tmp_path):
    """``load({"c": base.conj(), "r": base2.conj().imag})`` returned success with both zero."""
    c, r = torch.randn(4, 3, dtype=torch.complex64), torch.randn(4, 3)
    ucp_zarr.save({"c": c, "r": r}, tmp_path / "ck")
    base, base2 = torch.zeros(4, 3, dtype=torch.complex64), torch.zeros(4, 3, dtype=torch.complex64)
    ucp_zarr.load({"c": base.conj(), "r": base2.conj().imag}, tmp_path / "ck")
    assert torch.equal(base, c.conj()) and torch.equal(base2.imag, -r) and not base2.real.any()


def test_shard_and_flatshard_locals_of_any_view(tmp_path):
    w = torch.randn(8, 6, dtype=torch.complex64)
    ucp_zarr.save({"w": w, "v": w.real.clone()}, tmp_path / "ck")
    base = torch.zeros(6, 5, dtype=torch.complex64)  # rows 4..7 of w, through a transposed conjugate view
    flat = torch.zeros(40)  # elements 3..22 of v, every other element of a buffer, negated
    state = {
        "w": Shard(base.t().conj()[:4, :], (8, 6), (4, 0)),
        "v": FlatShard(flat.view(torch.complex64).conj().imag, (8, 6), 3),
    }
    ucp_zarr.load(state, tmp_path / "ck", strict=False)
    assert torch.equal(base[:, :4].t().conj(), w[4:8]) and not base[:, 4].any()
    assert torch.equal(-flat[1::2], w.real.reshape(-1)[3:23]) and not flat[0::2].any()


REFUSED: dict[str, Callable[[], torch.Tensor]] = {
    "expanded (stride 0)": lambda: torch.zeros(4).expand(6, 4),
    "overlapping strides": lambda: torch.zeros(30).as_strided((6, 4), (3, 1)),
    "broadcast scalar": lambda: torch.zeros(()).expand(6, 4),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_a_target_no_load_can_fill_is_refused_before_anything_is_read(tmp_path, kind):
    ucp_zarr.save({"a": torch.ones(6, 4), "t": torch.randn(6, 4)}, tmp_path / "ck")
    first = torch.zeros(6, 4)
    with pytest.raises(ucp_zarr.LayoutError, match=r"tensor 't'.*share memory"):
        ucp_zarr.load({"a": first, "t": REFUSED[kind]()}, tmp_path / "ck")
    assert not first.any()  # refused before anything was read
    with pytest.raises(ucp_zarr.LayoutError, match=r"tensor 't'.*share memory"):
        ucp_zarr.open(tmp_path / "ck").read("t", out=REFUSED[kind]())


def test_meta_and_dtensor_destinations_are_refused(tmp_path):
    ucp_zarr.save({"t": torch.randn(6, 4)}, tmp_path / "ck")
    with pytest.raises(ucp_zarr.LayoutError, match=r"tensor 't'.*meta device"):
        ucp_zarr.open(tmp_path / "ck").read("t", out=torch.empty(6, 4, device="meta"))
    with pytest.raises(ucp_zarr.LayoutError, match=r"tensor 't'.*meta device"):
        ucp_zarr.load({"t": torch.empty(6, 4, device="meta")}, tmp_path / "ck")


def test_a_loaded_parameter_bumps_its_version_like_copy_(tmp_path):
    """Autograd must see the change, as after ``param.copy_``: a backward through a graph
    that saved the old values raises instead of using the new ones."""
    ucp_zarr.save({"p": torch.randn(6, 4)}, tmp_path / "ck")
    p = torch.nn.Parameter(torch.randn(6, 4))
    loss = (p * p).sum()
    ucp_zarr.load({"p": p}, tmp_path / "ck")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_targets_that_share_memory(tmp_path):
    w, other = torch.randn(6, 4), torch.randn(6, 4)
    ucp_zarr.save({"emb": w, "head": w, "other": other, "even": w.reshape(-1)[:12], "odd": other.reshape(-1)[:12]},
                  tmp_path / "ck")
    # tied weights (one tensor under two keys) holding equal values: filled
    tied = torch.zeros(6, 4)
    ucp_zarr.load({"emb": tied, "head": tied}, tmp_path / "ck", strict=False)
    assert torch.equal(tied, w)
    # interleaved views share a storage but no element: filled
    buf = torch.zeros(24)
    ucp_zarr.load({"even": buf[0::2], "odd": buf[1::2]}, tmp_path / "ck", strict=False)
    assert torch.equal(buf[0::2], w.reshape(-1)[:12]) and torch.equal(buf[1::2], other.reshape(-1)[:12])
    # one tensor under two keys the checkpoint holds different values for: refused by name
    same = torch.zeros(6, 4)
    with pytest.raises(ucp_zarr.LayoutError, match=r"'(emb|other)' shares memory with '(emb|other)'"):
        ucp_zarr.load({"emb": same, "other": same}, tmp_path / "ck", strict=False)
    # ...and so are overlapping views of it
    with pytest.raises(ucp_zarr.LayoutError, match="shares memory"):
        ucp_zarr.load({"emb": buf.view(6, 4), "even": buf[6:18]}, tmp_path / "ck", strict=False)


def test_tied_model_weights_load(tmp_path):
    """A model whose output layer is tied to its embedding (GPT-2 style): its state dict
    holds one tensor under two keys."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    src, dst = Tied(), Tied()
    ucp_zarr.save(src.state_dict(), tmp_path / "ck")
    ucp_zarr.load(dst.state_dict(), tmp_path / "ck")
    assert torch.equal(dst.emb.weight, src.emb.weight) and dst.head.weight is dst.emb.weight
