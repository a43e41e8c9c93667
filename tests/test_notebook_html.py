"""The Jupyter face (ucp_zarr.browse.notebook): checkpoint and tensor HTML, statistics, diffs, plots.

The HTML is parsed (html.parser) and checked for what a reader sees: the tree with each
parameter's moments in its group, escaped keys and values, values and bytes by module and
dtype, the tree's filter, the picture of which rank wrote which region of a multi-rank save,
the diff table and its header when everything differs; the plots are checked against numbers
computed here with torch; rendering over S3 fetches nothing beyond what open() read. Runs of
steps: tests/test_runs.py."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import uuid
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest
import torch
from _dist import run

import ucp_zarr
from ucp_zarr.browse import changes, notebook, plots
from ucp_zarr.browse.checkpoint import Checkpoint
from ucp_zarr.format.commit_record import CheckpointMeta, TensorEntry
from ucp_zarr.browse.diff import diff
from ucp_zarr.io.factory import open_store

matplotlib.use("Agg")


class Dom(HTMLParser):
    """A tiny DOM: every element as (tag, attrs, parent index), with the text inside it."""

    VOID = {"br", "img", "hr", "meta", "input"}

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.nodes: list[dict[str, Any]] = []
        self.stack: list[int] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.nodes.append({"tag": tag, "attrs": dict(attrs), "parent": self.stack[-1] if self.stack else None, "text": ""})
        if tag not in self.VOID:
            self.stack.append(len(self.nodes) - 1)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.nodes.append({"tag": tag, "attrs": dict(attrs), "parent": self.stack[-1] if self.stack else None, "text": ""})

    def handle_endtag(self, tag: str) -> None:
        while self.stack:
            if self.nodes[self.stack.pop()]["tag"] == tag:
                break

    def handle_data(self, data: str) -> None:
        for i in self.stack:
            self.nodes[i]["text"] += data

    def find(self, tag: str, **attrs: str) -> list[dict[str, Any]]:
        return [n for n in self.nodes if n["tag"] == tag and all(n["attrs"].get(k) == v for k, v in attrs.items())]

    def inside(self, node: dict[str, Any], tag: str) -> list[dict[str, Any]]:
        """The ``tag`` elements below ``node``."""
        idx = self.nodes.index(node)
        out = []
        for n in self.nodes:
            p = n["parent"]
            while p is not None and p != idx:
                p = self.nodes[p]["parent"]
            if p == idx and n["tag"] == tag:
                out.append(n)
        return out


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.head(h)


def _trained(named: bool) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.named_parameters() if named else net.parameters(), lr=1e-2)
    net(torch.arange(6)).pow(2).mean().backward()
    opt.step()
    return net, opt


def _groups(html: str) -> dict[str, set[str]]:
    """Group name (as the tree labels it, with its module path) -> the keys its table lists."""
    dom = Dom(html)
    out: dict[str, set[str]] = {}
    for det in dom.find("details", **{"class": "group"}):
        names = []
        p = det["parent"]
        while p is not None:
            node = dom.nodes[p]
            if node["tag"] == "details":
                names.append(dom.inside(node, "b")[0]["text"])
            p = node["parent"]
        label = ".".join([*reversed(names), dom.inside(det, "code")[0]["text"]])
        out[label] = {c["text"] for c in dom.inside(det, "td") if c["attrs"].get("class") == "key"}
    return out


@pytest.mark.parametrize("keys", ["param_ids", "param_names", "fqns"])
def test_tree_shows_moments_beside_their_parameter(tmp_path: Path, keys: str) -> None:
    """Moments keyed by parameter number (names from the model given to save, or from the
    optimizer's ``param_names``) or by FQN (as ``get_state_dict`` keys them) sit in their
    parameter's group."""
    net, opt = _trained(named=keys == "param_names")
    fqns = [k for k, _ in net.named_parameters()]
    optim = opt.state_dict()
    if keys == "fqns":
        optim = {"state": {fqns[i]: st for i, st in optim["state"].items()}}
    state = {"model": net.state_dict(), "optim": optim, "step": 7}
    ucp_zarr.save(state, tmp_path / "ck", model=net if keys == "param_ids" else None)
    ck = ucp_zarr.open(tmp_path / "ck")
    html = ck._repr_html_()
    groups = _groups(html)
    assert sorted(groups) == sorted(fqns)
    for i, fqn in enumerate(fqns):
        moment = f"optim.state.{fqn if keys == 'fqns' else i}"
        assert groups[fqn] == {f"model.{fqn}", f"{moment}.exp_avg", f"{moment}.exp_avg_sq", f"{moment}.step"}, fqn
    text = "".join(n["text"] for n in Dom(html).find("table", **{"class": "facts"})).replace(" ", "")
    assert "step7" in text and "signedno" in text and "savedby1rank" in text
    assert len(Dom(html).find("details", **{"class": "module"})) == 4  # blocks > 0, 1, 2


def test_odd_keys_and_values_are_escaped(tmp_path: Path) -> None:
    evil = "<script>alert('k')</script>"
    state = {
        "model": {evil: torch.ones(3), "a&b\"'<i>": torch.zeros(2, 2)},
        "note": "<img src=x onerror=alert(1)>",
        "step": 1,
    }
    ucp_zarr.save(state, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    for html in (ck._repr_html_(), ck[f"model.{evil}"]._repr_html_(), ck["model.a&b\"'<i>"]._repr_html_()):
        assert "<script" not in html and "<img" not in html and "<i>" not in html
        dom = Dom(html)
        assert not dom.find("script") and not dom.find("img") and not dom.find("i")
    html = ck._repr_html_()
    assert "&lt;script&gt;alert(&#x27;k&#x27;)&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert f"model.{evil}" in {c["text"] for c in Dom(html).find("td", **{"class": "key"})}
    assert evil in {d["attrs"]["data-name"] for d in Dom(html).find("details", **{"class": "group"})}


def test_huge_checkpoint_html_is_bounded(tmp_path: Path) -> None:
    n = 150
    ucp_zarr.save({"model": {f"p{i}": torch.full((2,), float(i)) for i in range(n)}}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    html = notebook.checkpoint_html(ck, max_rows=30)
    dom = Dom(html)
    assert len(dom.find("td", **{"class": "key"})) == 30
    assert len(dom.find("details", **{"class": "group"})) == notebook.MAX_CHILDREN
    assert f"and {n - notebook.MAX_CHILDREN} more groups ({n - notebook.MAX_CHILDREN} tensors" in html
    assert "arrays not listed" in html


def test_tree_of_20k_tensors_is_bounded() -> None:
    """A commit record of 20,000 tensors in 4 levels of modules (no save: the tree is drawn
    from the index; with ``max_rows=0`` no array document is needed)."""
    digest = "sha256:" + "0" * 64
    tensors = {}
    for layer, expert, name in itertools.product(range(20), range(100), ("w1", "w2", "w3", "b1", "b2", "g", "h", "k", "q", "v")):
        fqn = f"layers.{layer}.experts.{expert}.{name}"
        tensors[f"model.{fqn}"] = TensorEntry(f"{fqn}/model", (4,), "float32", digest)
    meta = CheckpointMeta(tensors, {}, "2026-01-01T00:00:00+00:00", "ucp_zarr", "0" * 32)
    ck = Checkpoint(open_store(f"memory://nb-{uuid.uuid4().hex[:8]}/huge"), meta)
    html = notebook.checkpoint_html(ck, max_rows=0, max_nodes=500)
    dom = Dom(html)
    assert len(dom.find("details", **{"class": "module"}) + dom.find("details", **{"class": "group"})) == 500
    assert len(html) < 200_000
    assert "<td>tensors</td><td>20,000, 312.5 KiB</td>" in html


# --- values and bytes by module and dtype; the tree's filter ---------------------------------


def _table_rows(html: str, cls: str) -> dict[str, list[str]]:
    """The rows of the table of class ``cls``: first cell -> the other cells' text."""
    dom = Dom(html)
    table = dom.find("table", **{"class": cls})[0]
    rows = {}
    for tr in dom.inside(table, "tr"):
        cells = [td["text"] for td in dom.inside(tr, "td")]
        if cells:
            rows[cells[0]] = cells[1:]
    return rows


def test_summary_by_module_and_dtype(tmp_path: Path) -> None:
    net, opt = _trained(named=True)
    net.head.weight.data = net.head.weight.data.bfloat16().float()
    sd = net.state_dict()
    sd["head.weight"] = sd["head.weight"].bfloat16()
    optim = opt.state_dict()
    ucp_zarr.save({"model": sd, "optim": optim, "step": 3, "rng": ucp_zarr.PerRank(torch.arange(4))}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    summary = ck.summary()
    moments = [t for st in optim["state"].values() for t in st.values()]
    assert summary.parameters == summary.total.model == sum(t.numel() for t in sd.values())
    assert summary.total.optimizer == sum(t.numel() for t in moments)  # exp_avg, exp_avg_sq and the step counts
    assert summary.total.other == 4 and summary.total.nbytes == ck.nbytes()
    mods = {r.name: r for r in summary.modules}
    assert list(mods) == ["embed", "blocks.0", "blocks.1", "blocks.2", "head", ""]
    assert mods["blocks.1"].model == 8 * 8 + 8 and mods["blocks.1"].optimizer == 2 * (8 * 8 + 8) + 2
    assert mods["head"].dtypes == {"bfloat16": 4 * 8 * 2, "float32": 2 * 4 * 8 * 4 + 4}  # moments in fp32, step
    assert mods[""].other == 4 and mods[""].tensors == 1  # rng, per-rank, at the top level
    dtypes = {r.name: r for r in summary.dtypes}
    assert dtypes["bfloat16"].model == 32 and dtypes["bfloat16"].nbytes == 64 and summary.dtypes[0].name == "float32"
    assert [r.name for r in ck.summary(depth=1).modules] == ["embed", "blocks", "head", ""]
    with pytest.raises(ValueError, match="depth is a positive integer"):
        ck.summary(depth=0)
    # the HTML: the same numbers, as the checkpoint's view shows them too
    html = summary._repr_html_()
    rows = _table_rows(html, "modules")
    assert rows["blocks.1"][:5] == ["8", "72", "146", "0", notebook.human_bytes(mods["blocks.1"].nbytes)]
    assert rows["total"][1] == f"{summary.total.model:,}" and rows["(top level)"][3] == "4"
    assert "bfloat16 64 B" in rows["head"][-1]
    assert _table_rows(html, "dtypes")["bfloat16"][1] == "32"
    view = ck._repr_html_()
    assert _table_rows(view, "modules") == rows
    facts = "".join(n["text"] for n in Dom(view).find("table", **{"class": "facts"}))
    assert f"{summary.total.model:,} model (parameters and buffers) \u00b7 {summary.total.optimizer:,} optimizer state" in facts
    assert json.loads(json.dumps(summary.to_dict()))["total"]["model"] == summary.parameters


def test_summary_of_a_huge_index_is_bounded() -> None:
    digest = "sha256:" + "0" * 64
    tensors = {f"model.layers.{i}.w": TensorEntry(f"layers.{i}.w/model", (4,), "float32", digest) for i in range(500)}
    ck = Checkpoint(open_store(f"memory://nb-{uuid.uuid4().hex[:8]}/s"), CheckpointMeta(tensors, {}, "x", "ucp_zarr", "0" * 32))
    html = notebook.summary_html(ck.summary(), max_rows=10)
    rows = _table_rows(html, "modules")
    assert len(rows) == 12 and rows["\u2026 490 more modules"][:2] == ["490", "1,960"] and rows["total"][1] == "2,000"


def test_tree_filter(tmp_path: Path) -> None:
    """``ck.tree(filter)``: the groups whose name or keys hold the text (optimizer state keyed by
    number is found by its parameter's name); the checkpoint's view has the filter box."""
    net, opt = _trained(named=False)
    ucp_zarr.save({"model": net.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck", model=net)
    ck = ucp_zarr.open(tmp_path / "ck")
    tree = ck.tree(filter="BLOCKS.1")
    fqns = [k for k, _ in net.named_parameters()]
    want = {f"model.blocks.1.{n}" for n in ("weight", "bias")}
    want |= {f"optim.state.{fqns.index(f'blocks.1.{n}')}.{m}"
             for n in ("weight", "bias") for m in ("exp_avg", "exp_avg_sq", "step")}
    assert set(tree.keys) == want
    groups = _groups(tree._repr_html_())
    assert set(groups) == {"blocks.1.weight", "blocks.1.bias"} and set().union(*groups.values()) == want
    assert repr(tree).endswith(f"{len(want)} of {len(ck)} tensors matching 'BLOCKS.1'>")
    assert set(ck.tree(filter="exp_avg_sq").keys) == {k for k in ck.keys() if k.endswith("exp_avg_sq")}
    assert ck.tree(filter="nothing").keys == [] and "0 of" in ck.tree(filter="nothing")._repr_html_()
    box = Dom(ck._repr_html_()).find("input", **{"class": "ucpz-filter"})
    assert len(box) == 1 and "querySelectorAll('details.group')" in box[0]["attrs"]["oninput"]
    names = {d["attrs"]["data-name"] for d in Dom(ck._repr_html_()).find("details", **{"class": "group"})}
    assert names == set(fqns)


# --- the rank picture of a multi-rank save ---------------------------------------------------

WORLD = 3
ROWS, COLS, FLAT = (256, 128), (256, 128), (37, 29)


def _fragments(rank: int, world: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    w, f = torch.randn(*ROWS, generator=g), torch.randn(*FLAT, generator=g)
    rows = [ROWS[0] * r // world for r in range(world + 1)]
    cols = [COLS[1] * r // world for r in range(world + 1)]
    n = f.numel()
    lo, hi = n * rank // world, n * (rank + 1) // world
    return {
        "rows": ucp_zarr.Shard(w[rows[rank] : rows[rank + 1]].clone(), ROWS, (rows[rank], 0)),
        "cols": ucp_zarr.Shard(w[:, cols[rank] : cols[rank + 1]].clone(), COLS, (0, cols[rank])),
        "flat": ucp_zarr.FlatShard(f.reshape(-1)[lo:hi].clone(), FLAT, lo),
        "rep": torch.arange(12.0),
        "rng": ucp_zarr.PerRank(torch.tensor([rank, 7])),
    }


def _save_job(rank: int, world: int, path: str) -> None:
    ucp_zarr.save(_fragments(rank, world), path, chunk_bytes=4096, shard_bytes=8192)


@pytest.fixture(scope="module")
def multirank(tmp_path_factory: pytest.TempPathFactory) -> ucp_zarr.Checkpoint:
    path = str(tmp_path_factory.mktemp("multirank") / "ck")
    run(WORLD, _save_job, path, timeout_s=120)
    return ucp_zarr.open(path)


def _rects(html: str) -> list[tuple[int, float, float, float, float]]:
    return [
        (int(r["attrs"]["data-rank"]), *(float(r["attrs"][a]) for a in ("x", "y", "width", "height")))
        for r in Dom(html).find("rect")
        if r["attrs"].get("class") == "region"
    ]


def test_rank_picture_of_row_and_column_shards(multirank: ucp_zarr.Checkpoint) -> None:
    for key, dim in (("rows", 0), ("cols", 1)):
        html = multirank[key]._repr_html_()
        rects = sorted(_rects(html))
        assert [r[0] for r in rects] == list(range(WORLD))
        svg = Dom(html).find("svg")[0]
        w, h = float(svg["attrs"]["width"]) - 2, float(svg["attrs"]["height"]) - 2
        size = ROWS[0] if dim == 0 else COLS[1]
        for rank, x, y, rw, rh in rects:
            lo, hi = size * rank // WORLD, size * (rank + 1) // WORLD
            at, extent, full = (y, rh, h) if dim == 0 else (x, rw, w)
            assert at == pytest.approx(lo / size * full, abs=0.01) and extent == pytest.approx((hi - lo) / size * full, abs=0.01)
            assert (rw if dim == 0 else rh) == pytest.approx(w if dim == 0 else h, abs=0.01)
        assert "held by" in html and f"rank {WORLD - 1}" in html
        assert "stroke-dasharray" in html  # shard boundaries (8 KiB shards cut the tensor)


def test_rank_picture_of_flat_ranges_covers_the_tensor(multirank: ucp_zarr.Checkpoint) -> None:
    html = notebook.tensor_html(multirank["flat"])
    rects = _rects(html)
    svg = Dom(html).find("svg")[0]
    w, h = float(svg["attrs"]["width"]) - 2, float(svg["attrs"]["height"]) - 2
    assert {r[0] for r in rects} == set(range(WORLD))
    assert len(rects) > WORLD  # ranges cutting rows come out as up to three boxes each
    assert sum(r[3] * r[4] for r in rects) == pytest.approx(w * h, rel=1e-3)
    # each rank's area is its share of the elements
    n = math.prod(FLAT)
    for rank in range(WORLD):
        share = (n * (rank + 1) // WORLD - n * rank // WORLD) / n
        assert sum(r[3] * r[4] for r in rects if r[0] == rank) == pytest.approx(share * w * h, rel=1e-3)


def test_per_rank_state(multirank: ucp_zarr.Checkpoint) -> None:
    html = multirank["rng"]._repr_html_()
    assert f"one copy per saving rank ({', '.join(map(str, range(WORLD)))}); shown: rank 0's" in html
    tree = multirank._repr_html_()
    assert "per rank \u00d73" in tree and "per-rank state</td><td>1 tensor, 0 values" in tree


def test_facts_of_a_signed_converted_rules_checkpoint() -> None:
    """Layout, rules, signature and per-rank values as the facts table shows them (drawn from
    an index alone: nothing is read)."""
    rules = {"params": [{"kind": "fused", "patterns": ["qkv"], "sizes": [8, 8, 8]}, {"kind": "replicated", "patterns": ["norm"]}]}
    meta = CheckpointMeta(
        {"model.qkv": TensorEntry("qkv/model", (24, 8), "bfloat16", "sha256:" + "0" * 64, rule={"kind": "fused", "sizes": [8, 8, 8]})},
        {"step": 12}, "2026-01-01T00:00:00+00:00", "ucp_zarr 0.2.0", "0" * 32, world_size=8,
        layout={"rules": rules, "source": {"format": "deepspeed", "zero_stage": 2}}, rank_values={"seed": {0: 1, 1: 2}},
        signature={"alg": "HMAC-SHA256", "value": "00"},
    )
    ck = Checkpoint(open_store(f"memory://nb-{uuid.uuid4().hex[:8]}/facts"), meta)
    dom = Dom(notebook.checkpoint_html(ck, max_rows=0))
    facts = {tr_td[0]["text"]: tr_td[1]["text"] for tr_td in (
        dom.inside(tr, "td") for tr in dom.find("tr")) if len(tr_td) == 2 and tr_td[0]["text"] in (
        "step", "saved by", "signed", "rules", "source", "per-rank state", "tensors")}
    assert facts["step"] == "12" and facts["saved by"] == "8 ranks" and facts["signed"] == "yes (HMAC-SHA256)"
    assert facts["rules"].startswith("2 parameter rules (ck.rules)") and '"fused"' in facts["rules"]
    assert facts["source"] == '{"format": "deepspeed", "zero_stage": 2}'
    assert facts["per-rank state"] == "0 tensors, 1 value" and facts["tensors"] == "1, 384 B"


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def test_replicated_region_drawn_for_its_writer(multirank: ucp_zarr.Checkpoint) -> None:
    (region,) = multirank.array_meta("rep").regions
    assert region.replicas == tuple(range(WORLD))
    ((rank, *_),) = _rects(multirank["rep"]._repr_html_())
    assert rank == region.writers[0]


def test_tensor_html_facts_and_stats(multirank: ucp_zarr.Checkpoint) -> None:
    view = multirank["rows"]
    html = view._repr_html_()
    meta = multirank.array_meta("rows")
    assert "view.stats()" in html and "<th>mean</th>" not in html  # nothing computed in the repr
    text = "".join(n["text"] for n in Dom(html).find("table"))
    assert _shape_text(ROWS) in text and "float32" in text and f"dims {', '.join(meta.dims)}" in text
    assert "\u00d7".join(map(str, meta.grid.chunk_shape)) in text and "\u00d7".join(map(str, meta.grid.shard_shape)) in text
    with_stats = notebook.tensor_html(view, stats=view.stats())
    want = view[...].double()
    cells = {th["text"]: td["text"] for th, td in zip(Dom(with_stats).find("th"), Dom(with_stats).find("td", **{"class": "num"}))}
    assert float(cells["mean"]) == pytest.approx(want.mean().item(), rel=1e-5)
    assert float(cells["norm"]) == pytest.approx(want.norm().item(), rel=1e-5)
    assert cells["nan"] == "0" and cells["count"] == f"{math.prod(ROWS):,}"


def test_stats_html_flags_nan_and_inf(tmp_path: Path) -> None:
    t = torch.tensor([[1.0, float("nan")], [float("inf"), -2.0]], dtype=torch.bfloat16)
    ucp_zarr.save({"x": t}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    html = notebook.stats_html(ck["x"].stats())
    assert ck["x"].stats()._repr_html_() == html  # what Jupyter shows for view.stats()
    dom = Dom(html)
    bad = [td["text"] for td in dom.find("td") if "bad" in (td["attrs"].get("class") or "")]
    assert bad == ["1", "1"]
    cells = {th["text"]: td["text"] for th, td in zip(dom.find("th"), dom.find("td"))}
    assert float(cells["min"]) == -2.0 and float(cells["max"]) == 1.0 and cells["count"] == "4"


# --- diff ------------------------------------------------------------------------------------


def test_diff_table(tmp_path: Path) -> None:
    base = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3), "gone": torch.zeros(1), "s": torch.zeros(2)}
    ucp_zarr.save({"model": base, "step": 1}, tmp_path / "a")
    changed = dict(base, w=base["w"] + torch.tensor([[0, 0, 0.5], [0, 0, 0]]), s=torch.zeros(3), new=torch.ones(2))
    del changed["gone"]
    ucp_zarr.save({"model": changed, "step": 2}, tmp_path / "b")
    d = diff(ucp_zarr.open(tmp_path / "a"), ucp_zarr.open(tmp_path / "b"))
    html = changes.diff_html(d)
    assert d._repr_html_() == html
    dom = Dom(html)
    rows = {dom.inside(tr, "code")[0]["text"]: tr for tr in dom.find("tr") if tr["attrs"].get("data-status")}
    assert "tensors differ" not in html and "different" in html
    status = {k: tr["attrs"]["data-status"] for k, tr in rows.items()}
    assert status == {"model.w": "differs", "model.b": "equal", "model.gone": "only_a", "model.new": "only_b",
                      "model.s": "shape", "step": "differs"}
    assert rows["model.gone"]["attrs"]["class"] == rows["model.new"]["attrs"]["class"] == "only"
    cells = [td["text"] for td in dom.inside(rows["model.w"], "td")]
    assert cells[2] == "1" and float(cells[3]) == 0.5 and float(cells[4]) == pytest.approx(0.5 / 5.0)  # max abs / max |b|
    tensor_rows = [k for k in rows if k.startswith("model.")]
    assert tensor_rows[:2] == ["model.gone", "model.new"] and tensor_rows[-1] == "model.b"  # missing first, equal last
    values = dom.find("table", **{"class": "values"})[0]
    assert [td["text"] for td in dom.inside(values, "td")] == ["step", "1", "2"]


def test_diff_header_when_everything_differs(tmp_path: Path) -> None:
    """Steps of training (small updates), unrelated checkpoints (independent weights) and
    checkpoints with no key in common each get a header that says so; a long table shows its
    largest relative updates and keeps every row folded."""
    g = torch.Generator().manual_seed(5)
    a = {f"layers.{i}.w": torch.randn(16, 16, generator=g) for i in range(30)}
    stepped = {k: v + 1e-5 * 1.3 ** int(k.split(".")[1]) * torch.randn(16, 16, generator=g) for k, v in a.items()}
    unrelated = {k: torch.randn(16, 16, generator=g) for k in a}
    for name, model in (("a", a), ("stepped", stepped), ("unrelated", unrelated), ("renamed", {"x" + k: v for k, v in a.items()}),
                        ("few_a", dict(list(a.items())[:3])), ("few_b", dict(list(unrelated.items())[:3]))):
        ucp_zarr.save({"model": model}, tmp_path / name)

    def headline(html: str) -> tuple[str, str]:
        (div,) = [d for d in Dom(html).find("div") if "headline" in (d["attrs"].get("class") or "")]
        return div["attrs"]["class"], " ".join(div["text"].split())

    d = diff(tmp_path / "a", tmp_path / "stepped")
    html = d._repr_html_()
    cls, text = headline(html)
    assert cls == "headline" and "every one of the 30 tensors in common differs" in text
    assert "as between steps of training" in text
    rels = sorted(r.rel_update for r in d.rows)
    assert f"= {(rels[14] + rels[15]) / 2:.3g}" in text  # the median (of an even count: the mean of the middle two)
    dom = Dom(html)
    top = dom.find("table", **{"class": "diff top"})[0]
    keys = [c["text"] for c in dom.inside(top, "td") if c["attrs"].get("class") == "key"]
    assert keys == [f"model.layers.{i}.w" for i in range(29, 19, -1)]  # the largest updates: the last layers
    folded = dom.find("details", **{"class": "all"})[0]
    assert len([tr for tr in dom.inside(folded, "tr") if tr["attrs"].get("data-status")]) == 30
    assert "open" not in folded["attrs"]
    cells = {c["text"] for c in dom.inside(top, "td") if "rel" in (c["attrs"].get("class") or "")}
    assert f"{max(rels):.3g}" in cells

    cls, text = headline(diff(tmp_path / "a", tmp_path / "unrelated")._repr_html_())
    assert cls == "headline bad" and "These look like unrelated checkpoints" in text
    cls, text = headline(diff(tmp_path / "a", tmp_path / "renamed")._repr_html_())
    assert cls == "headline bad" and text.startswith("no tensor in common: A has 30 tensors, B 30")
    few = diff(tmp_path / "few_a", tmp_path / "few_b")._repr_html_()  # short: header, and the whole table open
    assert "unrelated" in headline(few)[1] and "<details" not in few and few.count("data-status='differs'") == 3
    assert "headline" not in diff(tmp_path / "a", tmp_path / "a")._repr_html_()


# --- plots -----------------------------------------------------------------------------------


def test_plot_norms_per_layer(tmp_path: Path) -> None:
    net, opt = _trained(named=False)
    ucp_zarr.save({"model": net.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    ax = plots.plot_norms(ck, "model.*")
    assert isinstance(ax, matplotlib.axes.Axes)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"model.blocks.*.weight", "model.blocks.*.bias"}
    # the tensors without a layer number (the head) are not drawn beside the layers: the title says so (before: nothing)
    assert ax.get_title() == "L2 norms of model.*; 2 without a layer number left out (model.embed.weight, model.head.weight)"
    sd = net.state_dict()
    for kind in ("weight", "bias"):
        assert list(lines[f"model.blocks.*.{kind}"].get_xdata()) == [0, 1, 2]
        want = [sd[f"blocks.{i}.{kind}"].double().norm().item() for i in range(3)]
        np.testing.assert_allclose(lines[f"model.blocks.*.{kind}"].get_ydata(), want, rtol=1e-6)
    bars = plots.plot_norms(ck, "model.head.*")  # no numbered layers: one bar per tensor
    assert [p.get_width() for p in bars.patches] == pytest.approx([sd["head.weight"].double().norm().item()], rel=1e-6)
    with pytest.raises(KeyError, match="nothing"):
        plots.plot_norms(ck, "nothing*")


def test_plot_histogram_streams_blocks(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    t = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    t[3, 5], t[7, 1] = float("nan"), float("-inf")
    ucp_zarr.save({"x": t}, tmp_path / "ck", chunk_bytes=2048)
    ck = ucp_zarr.open(tmp_path / "ck")
    fig, ax = matplotlib.pyplot.subplots()
    out = plots.plot_histogram(ck["x"], bins=40, ax=ax, max_bytes=4096)  # many blocks
    assert out is ax
    counts, edges = ax.patches[0].get_data().values, ax.patches[0].get_data().edges
    finite = t.float().numpy().ravel()
    finite = finite[np.isfinite(finite)]
    want, want_edges = np.histogram(finite, bins=np.linspace(float(finite.min()), float(finite.max()), 41))
    np.testing.assert_array_equal(edges, want_edges)
    np.testing.assert_array_equal(counts, want)
    assert "2 NaN/Inf left out" in ax.get_title()
    same = plots.plot_histogram(ck, "x", bins=40)
    np.testing.assert_array_equal(same.patches[0].get_data().values, want)


# --- remote checkpoints ----------------------------------------------------------------------


def _record_reads(store: Any) -> list[str]:
    """Record the keys the store is asked for (instance attributes shadow the methods)."""
    keys: list[str] = []
    for name in ("read", "read_tail", "readv"):
        method = getattr(store, name)

        def wrapped(key: str, *args: Any, _m: Any = method, **kwargs: Any) -> Any:
            keys.append(key)
            return _m(key, *args, **kwargs)

        setattr(store, name, wrapped)
    return keys


def test_memory_url_renders_and_plots(tmp_path: Path) -> None:
    url = f"memory://nb-{uuid.uuid4().hex[:8]}/ck"
    net, opt = _trained(named=True)
    ucp_zarr.save({"model": net.state_dict(), "optim": opt.state_dict(), "step": 3}, url)
    ck = ucp_zarr.open(url)
    keys = _record_reads(ck.store)
    html = ck._repr_html_() + ck["model.blocks.0.weight"]._repr_html_()
    assert url in html and "model.blocks.2.bias" in html
    assert keys == []  # everything from the commit record and its consolidated metadata
    hist = plots.plot_histogram(ck["model.blocks.0.weight"], bins=8)
    assert hist.patches[0].get_data().values.sum() == 64
    norms = plots.plot_norms(ck, "model.blocks.*.bias")
    assert [len(line.get_xdata()) for line in norms.get_lines()] == [3]


def test_s3_renders_from_metadata_only(seaweed: Any) -> None:
    from s3server import FaultProxy

    url = f"s3://objstore/{uuid.uuid4().hex[:8]}/nb"
    net, opt = _trained(named=True)
    big = {"model": net.state_dict(), "optim": opt.state_dict(), "extra": {"big": torch.randn(512, 512)}, "step": 3}
    ucp_zarr.save(big, url, storage_options=seaweed.storage_options())
    with FaultProxy(seaweed.s3_port) as proxy:
        ck = ucp_zarr.open(url, storage_options=seaweed.storage_options(proxy.endpoint))
        opened = proxy.counts.requests
        keys = _record_reads(ck.store)
        before = ck.store.stats.bytes_read
        html = ck._repr_html_() + notebook.tensor_html(ck["extra.big"])
        requests = proxy.counts.requests - opened
        read = ck.store.stats.bytes_read - before
    assert "extra.big" in html and "(512, 512)" in html
    # the root's consolidated metadata holds every array document: nothing more is fetched
    assert (keys, requests, read) == ([], 0, 0), (keys, requests, read)


def test_import_is_torch_free(tmp_path: Path) -> None:
    ucp_zarr.save({"model": {"w": torch.ones(4, 4)}, "step": 1}, tmp_path / "ck")
    code = (
        "import sys, ucp_zarr, ucp_zarr.browse.notebook as nb\n"
        f"html = nb.checkpoint_html(ucp_zarr.open({str(tmp_path / 'ck')!r}))\n"
        "assert 'model.w' in html\n"
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_group_is_shown_with_its_parameters_shape(tmp_path: Path) -> None:
    """A group's summary shows its parameter's shape, not its first array's: Adam's 0-d
    ``step`` saved before the weights made ``weight ()`` (now ``weight (64, 32)``)."""
    net = torch.nn.Linear(32, 64)
    opt = torch.optim.Adam(net.named_parameters())
    net(torch.randn(2, 32)).sum().backward()
    opt.step()
    ucp_zarr.save({"optim": opt.state_dict(), "model": net.state_dict()}, tmp_path / "ck")
    dom = Dom(ucp_zarr.open(tmp_path / "ck").tree()._repr_html_())
    shown = {dom.inside(d, "code")[0]["text"]: dom.inside(d, "summary")[0]["text"]
             for d in dom.find("details", **{"class": "group"})}
    assert "(64, 32)" in shown["weight"] and "(64,)" in shown["bias"], shown


def test_tensor_html_of_a_tied_alias(tmp_path: Path) -> None:
    """A tied alias shows as its kept tensor does (every read takes it; its HTML raised KeyError)."""
    w = torch.randn(4, 3)
    ucp_zarr.save({"model.emb.weight": w, "model.head.weight": w}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck.ties["model.head.weight"] == "model.emb.weight"
    html = ck["model.head.weight"]._repr_html_()
    assert "model.head.weight" in html and "4" in html
