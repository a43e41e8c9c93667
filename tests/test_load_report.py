"""A non-strict load says what it did not load: a warning naming the keys, and the lists
programmatically (as ``torch.nn.Module.load_state_dict`` returns them). Before, it returned
success and said nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

import ucp_zarr
from ucp_zarr import IncompatibleKeys, IncompatibleKeysWarning


@pytest.fixture
def ck(tmp_path):
    ucp_zarr.save({"model": {"w": torch.ones(3), "b": torch.ones(2)}, "step": 7, "note": "x"}, tmp_path / "ck")
    return tmp_path / "ck"


def test_non_strict_load_warns_naming_what_it_skipped(ck):
    target = {"model": {"w": torch.zeros(3), "extra": torch.zeros(4)}, "step": 0, "lr": 0.1}
    with pytest.warns(IncompatibleKeysWarning) as caught:
        state = ucp_zarr.load(target, ck, strict=False)
    assert state is target and torch.equal(target["model"]["w"], torch.ones(3)) and target["step"] == 7
    assert not target["model"]["extra"].any() and target["lr"] == 0.1  # left as they were
    (w,) = caught
    assert issubclass(w.category, UserWarning) and w.filename == __file__  # points at the caller's line
    assert w.message.missing_keys == ["model.extra", "lr"]
    assert w.message.unexpected_keys == ["model.b", "note"]
    text = str(w.message)
    assert "'model.extra', 'lr'" in text and "'model.b', 'note'" in text and str(ck) in text


def test_the_keys_without_catching_warnings(ck):
    target = {"model": {"w": torch.zeros(3), "extra": torch.zeros(4)}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # handed back, not warned
        state, keys = ucp_zarr.load(target, ck, strict=False, return_incompatible_keys=True)
    assert state is target and isinstance(keys, IncompatibleKeys)
    assert keys.missing_keys == ["model.extra"] and keys.unexpected_keys == ["model.b", "step", "note"]
    # the same field names as torch's
    torch_keys = torch.nn.Linear(2, 2).load_state_dict({"weight": torch.zeros(2, 2)}, strict=False)
    assert keys._fields == tuple(torch_keys._fields)


def test_nothing_skipped_nothing_said(ck):
    target = {"model": {"w": torch.zeros(3), "b": torch.zeros(2)}, "step": 0, "note": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ucp_zarr.load(target, ck, strict=False)
        _, keys = ucp_zarr.load(target, ck, return_incompatible_keys=True)
    assert keys == IncompatibleKeys([], [])


def test_a_long_list_is_cut_in_the_message_only(tmp_path):
    ucp_zarr.save({f"k{i}": i for i in range(50)}, tmp_path / "ck")
    with pytest.warns(IncompatibleKeysWarning, match=r"50 key\(s\): 'k0', .*'k19' and 30 more") as caught:
        ucp_zarr.load({}, tmp_path / "ck", strict=False)
    assert caught[0].message.unexpected_keys == [f"k{i}" for i in range(50)]


def test_strict_still_raises(ck):
    with pytest.raises(ucp_zarr.KeyMismatchError):
        ucp_zarr.load({"model": {"w": torch.zeros(3)}}, ck)
