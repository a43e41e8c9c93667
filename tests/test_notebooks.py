"""The notebooks of ``notebooks/`` run top to bottom on a real Jupyter kernel (nbclient), show
what they promise, and are kept in git with their (small) outputs.

Refresh the kept outputs with ``python tests/_notebooks.py``."""

from __future__ import annotations

import re

import nbformat
import pytest
from _notebooks import NOTEBOOKS, execute

MAX_NOTEBOOK_BYTES = 300_000
EXPECTED = ["elastic_resume.ipynb", "other_tools.ipynb", "quickstart.ipynb", "training_run.ipynb"]


def _outputs(nb: nbformat.NotebookNode) -> list[tuple[int, dict]]:
    return [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs]


def _html(nb: nbformat.NotebookNode) -> list[str]:
    return [o["data"]["text/html"] for _, o in _outputs(nb) if "text/html" in o.get("data", {})]


def _text(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for _, o in _outputs(nb) if o["output_type"] == "stream")


def _pngs(nb: nbformat.NotebookNode) -> list[str]:
    return [o["data"]["image/png"] for _, o in _outputs(nb) if "image/png" in o.get("data", {})]


def test_the_notebooks_are_there() -> None:
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_kept_copy_has_small_outputs(name: str) -> None:
    """The copy in git was executed (every code cell, in order) and kept its outputs, small."""
    path = NOTEBOOKS / name
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{name}: {path.stat().st_size} bytes"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name} was not run top to bottom"
    assert len({i for i, _ in _outputs(nb)}) >= len(code) - 2, f"{name} lost its outputs"
    assert not [o for _, o in _outputs(nb) if o["output_type"] == "error"]


def test_quickstart() -> None:
    nb, _ = execute("quickstart.ipynb")
    html = _html(nb)
    tree = next(h for h in html if "ucp_zarr checkpoint" in h)
    assert re.search(r"<details class='group' data-name='[^']+' open>", tree) and "<details class='module'" in tree
    assert "optim.exp_avg_sq" in tree  # moments listed in their parameter's group
    assert "class='ucpz-filter'" in tree and "<table class='modules'>" in tree  # the filter box, the summary
    assert any("<svg" in h and "class='region'" in h for h in html)  # the tensor view
    assert any("<th>norm</th>" in h for h in html)  # its statistics
    diff = next(h for h in html if "data-status" in h)
    assert "values differ" in diff
    assert len(_pngs(nb)) == 2  # the norm plot, the histograms
    m = re.search(r"\(2, 64\) torch.float32: ([\d,]+) bytes read of ([\d,]+)", _text(nb))
    assert m and int(m[1].replace(",", "")) < int(m[2].replace(",", "")) / 2  # a partial read


def test_training_run() -> None:
    """A manager run of 4 steps: its table, a summary, a filtered tree, norms and updates over
    steps, histograms across steps, a diff of two steps (small updates) and of unrelated
    checkpoints (said so)."""
    nb, _ = execute("training_run.ipynb")
    html = _html(nb)
    assert "steps saved: [0, 2, 4, 6]" in _text(nb)
    run = next(h for h in html if "ucp_zarr run" in h)
    assert run.count("data-state='committed'") == 4
    summary = next(h for h in html if "<b>summary</b>" in h)
    assert "<td><code>blocks.2</code></td>" in summary and "<table class='dtypes'>" in summary
    tree = next(h for h in html if "<b>tree</b>" in h)
    names = re.findall(r"data-name='([^']+)'", tree)
    assert len(names) == 6 and all(".fc1." in n for n in names)
    norms = next(h for h in html if "L2 norm</b> of 3 tensors at 4 steps" in h)
    assert norms.count("<td class='key'>") == 3
    diffs = [h for h in html if "class='headline" in h]
    assert len(diffs) == 2
    assert "class='headline'>" in diffs[0] and "as between steps of training" in diffs[0]
    assert "class='headline bad'>" in diffs[1] and "unrelated checkpoints" in diffs[1]
    assert len(_pngs(nb)) == 3  # norms and updates, histograms, updates by layer


def test_elastic_resume() -> None:
    nb, _ = execute("elastic_resume.ipynb")
    text = _text(nb)
    assert "not bit-identical to the saved ones: []" in text
    steps = re.findall(r"step \d+: reference ([\d.]+)  resumed ([\d.]+)", text)
    assert len(steps) == 4 and all(abs(float(a) - float(b)) <= 1e-5 * float(a) for a, b in steps)
    assert len(_pngs(nb)) == 1  # both loss curves
    pictures = [h for h in _html(nb) if "<svg" in h]
    assert len(pictures) == 2
    for h in pictures:  # regions of all four saving ranks
        assert set(re.findall(r"data-rank='(\d+)'", h)) == {"0", "1", "2", "3"}


def test_other_tools() -> None:
    """Reads through zarr-python, TensorStore, dask and xarray (the notebook asserts the values
    bit for bit and that neither ucp_zarr nor torch was imported)."""
    nb, _ = execute("other_tools.ipynb")
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    imports = re.findall(r"^\s*(?:import|from) (\w+)", code, re.M)
    assert "ucp_zarr" not in imports and "torch" not in imports
    for tool in ("zarr", "tensorstore", "dask", "xarray"):
        assert tool in imports
    text = _text(nb)
    assert "ts.cast:" in text and "view:" in text
    assert any("xarray.Dataset" in h for h in _html(nb))


def test_execution_times_are_small() -> None:
    """Each notebook stays a short CI step (they run in this process's cache; measured here)."""
    for name in EXPECTED:
        _, seconds = execute(name)
        assert seconds < 240, f"{name} took {seconds:.0f} s"
