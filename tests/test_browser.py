"""The executed quickstart, rendered to HTML by nbconvert, in a real browser (headless Chromium):
the checkpoint tree, the tables and the plots are in the page the browser built, and a
screenshot of it is kept as a test artefact (``$UCP_ZARR_ARTEFACTS``, else pytest's tmp dir).

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
    groups = re.findall(r"<details class=\"group\"( open=\"\")?>", dom)  # the DOM the browser built (attributes re-quoted)
    assert len(groups) >= 4 and groups.count(" open=\"\"") == 1
    assert re.search(r"<td class=\"key\"><code>model\.wte\.weight</code></td>", dom)  # a group's table
    assert 'class="facts"' in dom and "<th>norm</th>" in dom and 'data-status="differs"' in dom
    assert re.search(r"<rect class=\"region\" data-rank=\"0\"", dom)  # the tensor's rank picture
    pngs = re.findall(r"<img [^>]*src=\"data:image/png;base64,([A-Za-z0-9+/=]+)\"", dom)
    assert len(pngs) == 2 and all(base64.b64decode(p)[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)

    out = Path(os.environ.get("UCP_ZARR_ARTEFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "quickstart.png"
    shot.unlink(missing_ok=True)
    _browse(chromium, f"--screenshot={shot}", "--window-size=1100,3000", page.as_uri())
    from matplotlib.image import imread

    pixels = imread(shot)
    assert pixels.shape[:2] == (3000, 1100)
    # not a blank page: the text, tables and plots give many distinct colours
    assert len({tuple(p) for p in pixels[::7, ::7, :3].reshape(-1, 3).tolist()}) > 100
