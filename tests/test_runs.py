"""A training run in a notebook (ucp_zarr.browse.runs, the relative update of ucp_zarr.diff): the steps
of a manager root, norms, updates and histograms over steps against numbers computed here
with torch, on a local path, an in-memory URL and a real S3 server, and bounded memory
without torch on a checkpoint run larger than the bound."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from test_notebook_html import Dom

import ucp_zarr
from ucp_zarr.browse import changes, notebook, plots
from ucp_zarr.browse.diff import diff

matplotlib.use("Agg")

STEPS = (0, 3, 6)


def _states() -> dict[int, dict[str, Any]]:
    """Three steps of a small model: layers 0-2 (weights move by a known amount), a head, a
    bf16 tensor, optimizer state keyed by number, and a step counter."""
    g = torch.Generator().manual_seed(0)
    w = {f"layers.{i}.{n}": torch.randn(16, 8, generator=g) for i in range(3) for n in ("attn.weight", "mlp.weight")}
    w["head.weight"] = torch.randn(4, 16, generator=g)
    out = {}
    for step in STEPS:
        moved = {k: v + step * 0.01 * (1 + i) * torch.randn(v.shape, generator=g) for i, (k, v) in enumerate(w.items())}
        model = dict(moved, **{"emb.weight": moved["head.weight"].t().contiguous().bfloat16()})
        optim = {"state": {i: {"exp_avg": v * 0.1, "step": torch.tensor(float(step))} for i, v in enumerate(moved.values())}}
        out[step] = {"model": model, "optim": optim, "step": step}
    return out


def _save_run(root: str) -> dict[int, dict[str, Any]]:
    states = _states()
    with ucp_zarr.CheckpointManager(root) as manager:
        for step, state in states.items():
            manager.save(step, state)
    return states


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("run") / "root")
    return root, _save_run(root)


def _norm(t: torch.Tensor) -> float:
    return t.double().norm().item()


def _check_numbers(run: Any, states: dict[int, dict[str, Any]]) -> None:
    norms = run.norms("model.layers.*.attn.weight")
    assert norms.steps == STEPS and sorted(norms.values) == [f"model.layers.{i}.attn.weight" for i in range(3)]
    for key, values in norms.values.items():
        want = [_norm(states[s]["model"][key[len("model."):]]) for s in STEPS]
        np.testing.assert_allclose(values, want, rtol=1e-12)
    updates = run.updates()
    assert updates.steps == STEPS[1:] and updates.previous == STEPS[:-1]
    assert "model.emb.weight" in updates.values and not any(k.startswith("optim.") for k in updates.values)
    for key, values in updates.values.items():
        name = key[len("model."):]
        want = [_norm(states[b]["model"][name].double() - states[a]["model"][name].double()) / _norm(states[a]["model"][name])
                for a, b in zip(STEPS, STEPS[1:])]
        np.testing.assert_allclose(values, want, rtol=1e-10, err_msg=key)


def test_run_steps_norms_updates(local_run: tuple[str, dict[int, dict[str, Any]]]) -> None:
    root, states = local_run
    run = ucp_zarr.open_run(root)
    assert run.committed == list(STEPS) and run.latest == 6 and repr(run).endswith("3 committed, latest 6>")
    ck = run[3]
    assert isinstance(ck, ucp_zarr.Checkpoint) and run[3] is ck and ck.metadata["step"] == 3
    with pytest.raises(KeyError, match=r"no committed step 4 under .*committed: \[0, 3, 6\]"):
        run[4]
    _check_numbers(run, states)
    only = run.updates("model.head.*", steps=[0, 6])
    head = [states[s]["model"]["head.weight"].double() for s in (0, 6)]
    want = _norm(head[1] - head[0]) / _norm(head[0])
    assert only.values == {"model.head.weight": (pytest.approx(want, rel=1e-10),)}
    with pytest.raises(KeyError, match="steps \\[5\\] are not committed"):
        run.norms("model.*", steps=[0, 5])
    with pytest.raises(KeyError, match="matches 'nothing'"):
        run.norms("nothing")


def test_run_html_lists_every_step_folder(tmp_path: Path) -> None:
    root = tmp_path / "root"
    states = _states()
    with ucp_zarr.CheckpointManager(root) as manager:
        manager.save(0, states[0])
        manager.save(3, states[3])
    (root / "step_00000009").mkdir()  # the remains of a deletion
    run = ucp_zarr.open_run(root)
    dom = Dom(run._repr_html_())
    rows = [r for r in dom.find("tr") if r["attrs"].get("data-state")]
    assert [r["attrs"]["data-state"] for r in rows] == ["committed", "committed", "leftover"]
    cells = [[td["text"] for td in dom.inside(r, "td")] for r in rows]
    assert [c[0] for c in cells] == ["0", "3", "9"]
    info = {s.step: s for s in run.steps}
    assert cells[1][2] == notebook.human_bytes(info[3].nbytes) and cells[1][3] == str(info[3].tensors)
    assert cells[1][5] == info[3].created[:19].replace("T", " ") and cells[1][6].endswith(" s")
    assert "bad" in dom.inside(rows[2], "td")[1]["attrs"]["class"]
    assert "3 step folders, 2 committed" in run._repr_html_()


def test_open_run_refuses_what_is_not_a_root(tmp_path: Path) -> None:
    ucp_zarr.save({"w": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(ucp_zarr.NotACheckpointError, match="is a checkpoint, not a root of steps: open it with ucp_zarr.open"):
        ucp_zarr.open_run(tmp_path / "ck")
    with pytest.raises(ucp_zarr.NotACheckpointError, match="holds no step folder .*empty or missing"):
        ucp_zarr.open_run(tmp_path / "nothing")


def test_histograms_across_steps(local_run: tuple[str, dict[int, dict[str, Any]]]) -> None:
    root, states = local_run
    run = ucp_zarr.open_run(root)
    key = "model.emb.weight"  # bf16, widened exactly
    h = run.histograms(key, bins=12, max_bytes=64)  # many blocks
    values = [states[s]["model"]["emb.weight"].float().numpy().ravel() for s in STEPS]
    edges = np.linspace(min(v.min() for v in values), max(v.max() for v in values), 13)
    np.testing.assert_array_equal(h.edges, edges)
    np.testing.assert_array_equal(h.counts, np.stack([np.histogram(v, bins=edges)[0] for v in values]))
    assert h.steps == STEPS and h.skipped == (0, 0, 0)
    exp_avg = next(k for k in run[0].keys() if k.endswith(".exp_avg"))
    assert run.histograms(exp_avg, steps=[3, 6]).steps == (3, 6)
    labels = ["step 0", "step 3", "step 6"]
    for kind in ("ridge", "heatmap", "overlay"):
        fig, ax = plt.subplots()
        assert h.plot(kind, ax=ax, log=kind == "heatmap") is ax
        shown = [t.get_text() for t in (ax.get_legend().get_texts() if kind == "overlay" else ax.get_yticklabels())]
        assert shown == labels, kind
        plt.close(fig)
    ridge = h.plot("ridge")
    assert [p.get_data().baseline for p in ridge.patches] == [2, 1, 0]  # the first step on top
    with pytest.raises(ValueError, match="kind is one of"):
        h.plot("violin")


def test_series_plot_and_table(local_run: tuple[str, dict[int, dict[str, Any]]]) -> None:
    root, _ = local_run
    run = ucp_zarr.open_run(root)
    norms = run.norms("model.layers.*")
    ax = norms.plot()
    assert [line.get_label() for line in ax.get_lines()] == list(norms.values)
    np.testing.assert_array_equal(ax.get_lines()[0].get_xdata(), STEPS)
    many = run.norms(["model.*", "optim.*"])  # over MAX_LINES: grey lines and their median
    ax = many.plot()
    assert len(many.values) > changes.MAX_LINES and ax.get_lines()[-1].get_label() == f"median of {len(many.values)} tensors"
    ys = np.array([[np.nan if v is None else v for v in vs] for vs in many.values.values()])
    np.testing.assert_allclose(ax.get_lines()[-1].get_ydata(), np.nanmedian(ys, axis=0))
    assert run.updates().plot().get_yscale() == "log"
    dom = Dom(norms._repr_html_())
    assert [th["text"] for th in dom.find("th")][1:] == ["0", "3", "6"]
    assert {td["text"] for td in dom.find("td", **{"class": "key"})} == set(norms.values)
    assert json.loads(json.dumps(many.to_dict()))["steps"] == list(STEPS)


# --- the relative update of a diff ------------------------------------------------------------


def test_diff_relative_update(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    a = {"w": torch.randn(64, 32, generator=g), "z": torch.zeros(5), "same": torch.ones(3),
         "h": torch.randn(40, generator=g).half()}
    b = {"w": a["w"] + 1e-3 * torch.randn(64, 32, generator=g), "z": torch.tensor([0, 0, 3.0, 4.0, 0]), "same": a["same"],
         "h": a["h"].float() * 1.5}
    a["w"][3, 3] = b["w"][5, 5] = float("nan")  # left out of the norms
    ucp_zarr.save(a, tmp_path / "a", chunk_bytes=1024)
    ucp_zarr.save(b, tmp_path / "b", chunk_bytes=1024)
    rows = {r.key: r for r in diff(tmp_path / "a", tmp_path / "b", max_bytes=512).rows}
    both = ~(a["w"].isnan() | b["w"].isnan())
    wa = a["w"].double().nan_to_num(0.0)
    assert rows["w"].norm_a == pytest.approx(wa.norm().item(), rel=1e-12)
    assert rows["w"].norm_delta == pytest.approx((b["w"].double() - a["w"].double())[both].norm().item(), rel=1e-12)
    assert rows["w"].rel_update == pytest.approx(rows["w"].norm_delta / rows["w"].norm_a) and rows["w"].rel_update < 1e-2
    assert (rows["z"].norm_a, rows["z"].norm_delta, rows["z"].rel_update) == (0.0, 5.0, math.inf)
    assert (rows["same"].rel_update, rows["same"].status) == (0.0, "equal")
    assert rows["h"].status == "dtype" and rows["h"].rel_update == pytest.approx(0.5, rel=1e-12)  # compared as numbers
    out = rows["z"].to_dict()
    assert out["rel_update"] == "inf" and out["norm_delta"] == 5.0


def test_plot_updates_by_layer(local_run: tuple[str, dict[int, dict[str, Any]]]) -> None:
    root, states = local_run
    run = ucp_zarr.open_run(root)
    d = ucp_zarr.diff(run[0], run[3])
    ax = plots.plot_updates(d)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"model.layers.*.attn.weight", "model.layers.*.mlp.weight"}  # the model's only
    rel = {r.key: r.rel_update for r in d.rows}
    for name, line in lines.items():
        assert list(line.get_xdata()) == [0, 1, 2]
        np.testing.assert_allclose(line.get_ydata(), [rel[name.replace("*", str(i))] for i in range(3)])
    assert ax.get_yscale() == "log" and "step_00000000 \u2192 step_00000003" in ax.get_title()
    bars = plots.plot_updates(d, "model.head.*", log=False)  # no layer number: one bar per tensor
    assert [p.get_width() for p in bars.patches] == [pytest.approx(rel["model.head.weight"])]


# --- object stores ---------------------------------------------------------------------------


def test_memory_url_run() -> None:
    root = f"memory://run-{uuid.uuid4().hex[:8]}/root"
    states = _save_run(root)
    run = ucp_zarr.open_run(root)
    assert run.url == root and run.committed == list(STEPS)
    assert root in run._repr_html_()
    _check_numbers(run, states)


def test_s3_run(seaweed: Any) -> None:
    """Two steps on a real S3 server (written by plain saves into the manager's folder names):
    the table from a listing and the commit records, norms and updates from the tensors."""
    from s3server import FaultProxy

    from ucp_zarr.ops import step_name

    root = f"s3://objstore/{uuid.uuid4().hex[:8]}/run"
    g = torch.Generator().manual_seed(3)
    states = {s: {f"layers.{i}.w": torch.randn(8, 8, generator=g) for i in range(2)} for s in (10, 20)}
    for step, state in states.items():
        ucp_zarr.save({"model": state}, f"{root}/{step_name(step)}", storage_options=seaweed.storage_options())
    with FaultProxy(seaweed.s3_port) as proxy:
        run = ucp_zarr.open_run(root, storage_options=seaweed.storage_options(proxy.endpoint))
        html = run._repr_html_()
        listed = proxy.counts.requests
        norms, updates = run.norms("model.*"), run.updates()
    assert html.count("data-state='committed'") == 2 and root in html
    assert listed <= 12, listed  # listings and the commit record per step (no tensor data)
    for key in norms.values:
        a, b = (states[s][key[len("model."):]].double() for s in (10, 20))
        np.testing.assert_allclose(norms.values[key], [_norm(a), _norm(b)], rtol=1e-12)
        assert updates.values[key] == (pytest.approx(_norm(b - a) / _norm(a), rel=1e-12),)


# --- bounded memory, no torch ------------------------------------------------------------------

BIG = 4 << 20
"""Elements of each big tensor (16 MiB of float32)."""


def test_run_views_stream_in_bounded_memory(tmp_path: Path) -> None:
    """Three steps of two 16 MiB tensors: the run's table, a summary, norms, updates, histograms
    across steps and a diff with its HTML, computed in a process without torch whose peak
    memory grows by less than one tensor (``max_bytes`` = 1 MiB) while reading ~450 MiB."""
    g = torch.Generator().manual_seed(2)
    base = {"a": torch.randn(BIG, generator=g).reshape(-1, 1024), "b": torch.randn(BIG, generator=g).reshape(-1, 1024)}
    root = tmp_path / "root"
    want: dict[str, list[float]] = {"a": [], "b": []}
    with ucp_zarr.CheckpointManager(root) as manager:
        for step in range(3):
            state = {k: v + 0.01 * step for k, v in base.items()}
            manager.save(step, {"model": {"layers.0." + k: v for k, v in state.items()}, "step": step})
            for k, v in state.items():
                want[k].append(_norm(v))
    code = textwrap.dedent("""
        import json, sys
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot
        import ucp_zarr, ucp_zarr.browse.notebook, ucp_zarr.browse.runs

        def peak():
            return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) << 10

        open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
        before = peak()
        mb = 1 << 20
        run = ucp_zarr.open_run(sys.argv[1])
        html = run._repr_html_() + run[2]._repr_html_() + run[2].summary()._repr_html_()
        norms = run.norms("model.*", max_bytes=mb)
        updates = run.updates(max_bytes=mb)
        hist = run.histograms("model.layers.0.a", bins=20, max_bytes=mb)
        html += ucp_zarr.diff(run[0], run[2], max_bytes=mb)._repr_html_()
        hist.plot("ridge")
        print(json.dumps({"grew": peak() - before, "norms": norms.to_dict()["values"],
                          "updates": updates.to_dict()["values"], "count": int(hist.counts.sum()),
                          "torch": "torch" in sys.modules, "html": len(html)}))
    """)
    r = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    print(f"\n3 steps of 2 x 16 MiB: peak memory grew by {got['grew'] / 2**20:.1f} MiB")
    assert got["torch"] is False
    assert got["grew"] < BIG * 4, got["grew"]  # less than one tensor: never held whole
    for k in ("a", "b"):
        np.testing.assert_allclose(got["norms"][f"model.layers.0.{k}"], want[k], rtol=1e-10)
        assert got["updates"][f"model.layers.0.{k}"][0] == pytest.approx(0.01 * math.sqrt(BIG) / want[k][0], rel=1e-4)
    assert got["count"] == 3 * BIG
