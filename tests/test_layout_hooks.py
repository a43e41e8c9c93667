"""A layout plugs its checks into saves and loads through the hooks its Placed tensors carry
(ucp_zarr.protocol.hooks): the protocol calls them and knows nothing of the rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pytest
import torch

import ucp_zarr
from ucp_zarr.layout import pieces as P
from ucp_zarr.protocol.hooks import LayoutHooks


class Recording(LayoutHooks):
    """Records what the protocol asks; refuses or combines as told."""

    def __init__(self, refuse: bool = False, same: bool = True) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.refuse, self.same = refuse, same

    def check_placements(self, layout: Mapping[str, Any], used_by_rank: list[frozenset[str]]) -> None:
        self.calls.append(("check_placements", (dict(layout), used_by_rank)))
        if self.refuse:
            raise ucp_zarr.LayoutError("refused by the layout")

    def same_form(self, saved: Mapping[str, Any] | None, loading: Mapping[str, Any] | None) -> bool:
        self.calls.append(("same_form", (saved, loading)))
        return self.same

    def combine(self, key: str, copies: list[torch.Tensor]) -> torch.Tensor:
        self.calls.append(("combine", key))
        return copies[0] * 2


def _placed(t: torch.Tensor, hooks: LayoutHooks, **kw: Any) -> ucp_zarr.Placed:
    return ucp_zarr.Placed(t, "w", tuple(t.shape), tuple(P.whole(tuple(t.shape))), meaning={"kind": "mine"},
                           rules={"layout": "mine"}, used=frozenset({"p"}), hooks=hooks, **kw)


def test_a_save_asks_the_layout_to_check_its_placements_and_to_combine_differing_replicas(tmp_path: Path) -> None:
    hooks = Recording()
    t = torch.arange(6, dtype=torch.float32)
    ucp_zarr.save({"w": _placed(t, hooks, average=True)}, tmp_path / "ck")
    assert ("check_placements", ({"layout": "mine"}, [frozenset({"p"})])) in hooks.calls
    assert ("combine", "w") in hooks.calls
    assert torch.equal(ucp_zarr.open(tmp_path / "ck")["w"][...], t * 2)  # what the layout combined is stored


def test_a_layout_that_refuses_its_placements_refuses_the_save(tmp_path: Path) -> None:
    with pytest.raises(ucp_zarr.LayoutError, match="refused by the layout"):
        ucp_zarr.save({"w": _placed(torch.ones(4), Recording(refuse=True))}, tmp_path / "ck")
    with pytest.raises(ucp_zarr.NotACheckpointError):
        ucp_zarr.open(tmp_path / "ck")


def test_a_load_asks_the_layout_whether_the_stored_form_is_the_one_it_expects(tmp_path: Path) -> None:
    ucp_zarr.save({"w": _placed(torch.ones(4), LayoutHooks())}, tmp_path / "ck")
    other = Recording(same=False)
    target = torch.zeros(4)
    with pytest.raises(ucp_zarr.LayoutError, match="another consolidated form"):
        ucp_zarr.load({"w": _placed(target, other)}, tmp_path / "ck")
    assert ("same_form", ({"kind": "mine"}, {"kind": "mine"})) in other.calls and not target.any()
    ucp_zarr.load({"w": _placed(target, other)}, tmp_path / "ck", allow_other_rules=True)
    assert torch.equal(target, torch.ones(4))
    strict = Recording()
    ucp_zarr.load({"w": _placed(target, strict)}, tmp_path / "ck")
    assert [c for c, _ in strict.calls] == ["check_placements", "same_form"]
