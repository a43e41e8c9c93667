"""The executed quickstart and training_run notebooks, rendered to HTML by nbconvert, in a real
browser (headless Chromium): the checkpoint tree, the run's steps, the summaries, the tables and
the plots are in the page the browser built, the tree's filter box filters it (its JavaScript
runs in the page, offline), and screenshots are kept as test artefacts (``$UCP_ZARR_ARTEFACTS``,
else pytest's tmp dir).

``.ci/run`` installs Debian's ``chromium`` when it is missing; without it the test skips."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _notebooks import execute

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=5000"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium on PATH: .ci/run installs Debian's chromium package (apt-get install chromium)")


def _browse(chromium: str, *args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([chromium, *FLAGS, *args], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def test_quickstart_in_chromium(tmp_path: Path) -> None:
    from nbconvert import HTMLExporter

    chromium = _chromium()
    nb, _ = execute("quickstart.ipynb")
    page = tmp_path / "quickstart.html"
    page.write_text(HTMLExporter().from_notebook_node(nb)[0])

    dom = _browse(chromium, "--dump-dom", page.as_uri()).stdout
    groups = re.findall(r"<details class=\"group\" data-name=\"[^\"]+\"( open=\"\")?>", dom)  # (attributes re-quoted)
    assert len(groups) >= 4 and groups.count(" open=\"\"") == 1
    assert re.search(r"<td class=\"key\"><code>model\.wte\.weight</code></td>", dom)  # a group's table
    assert 'class="facts"' in dom and "<th>norm</th>" in dom and 'data-status="differs"' in dom
    assert re.search(r"<rect class=\"region\" data-rank=\"0\"", dom)  # the tensor's rank picture
    pngs = re.findall(r"<img [^>]*src=\"data:image/png;base64,([A-Za-z0-9+/=]+)\"", dom)
    assert len(pngs) == 2 and all(base64.b64decode(p)[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)

    _screenshot(chromium, page, tmp_path, 3000)


def _screenshot(chromium: str, page: Path, tmp_path: Path, height: int) -> None:
    out = Path(os.environ.get("UCP_ZARR_ARTEFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    shot = out / page.with_suffix(".png").name
    shot.unlink(missing_ok=True)
    _browse(chromium, f"--screenshot={shot}", f"--window-size=1100,{height}", page.as_uri())
    from matplotlib.image import imread

    pixels = imread(shot)
    assert pixels.shape[:2] == (height, 1100)
    # not a blank page: the text, tables and plots give many distinct colours
    assert len({tuple(p) for p in pixels[::7, ::7, :3].reshape(-1, 3).tolist()}) > 100


# types into the tree's filter box once the page has loaded, as a reader would
_TYPE = ("<script>window.addEventListener('load',function(){var box=document.querySelector('input.ucpz-filter');"
         "box.value='2.FC1.W';box.dispatchEvent(new Event('input'));});</script></body>")


def test_training_run_in_chromium(tmp_path: Path) -> None:
    from nbconvert import HTMLExporter

    chromium = _chromium()
    nb, _ = execute("training_run.ipynb")
    page = tmp_path / "training_run.html"
    page.write_text(HTMLExporter().from_notebook_node(nb)[0].replace("</body>", _TYPE, 1))

    dom = _browse(chromium, "--dump-dom", page.as_uri()).stdout
    assert len(re.findall(r"<tr data-state=\"committed\">", dom)) == 4  # the run's steps
    assert 'class="modules"' in dom and 'class="dtypes"' in dom and "<td><code>blocks.2</code></td>" in dom
    assert 'class="headline"' in dom and 'class="headline bad"' in dom and 'class="diff top"' in dom
    pngs = re.findall(r"<img [^>]*src=\"data:image/png;base64,([A-Za-z0-9+/=]+)\"", dom)
    assert len(pngs) == 3 and all(base64.b64decode(p)[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    # the filter box, typed into: one group of the 6 (fc1's weights and biases of 3 blocks) stays
    groups = dict(re.findall(r"<details class=\"group\" data-name=\"([^\"]+)\"([^>]*)>", dom))
    assert len(groups) == 6 and {name for name, attrs in groups.items() if "hidden" not in attrs} == {"blocks.2.fc1.weight"}
    modules = {m: a for a, m in re.findall(r"<details class=\"module\"([^>]*)><summary><b>([^<]+)</b>", dom)}
    assert "hidden" not in modules["blocks"] and "hidden" not in modules["2.fc1"] and "hidden" in modules["0.fc1"]
    assert "1 group matches" in dom
    _screenshot(chromium, page, tmp_path, 4200)
