"""Run the Python code blocks of a documentation page, in order, as one script: in a fresh
process, as a reader would run them, or in this one (where its heavy imports are loaded
already: Lightning, transformers)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from _jobs import run_job

DOCS = Path(__file__).parent.parent / "docs"


def python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)


def run_page(page: str, cwd: Path, *, timeout: float = 300) -> str:
    """Run ``docs/<page>``'s Python blocks in ``cwd``; their output."""
    (cwd / "page.py").write_text("\n".join(python_blocks(page)))
    return run_job([sys.executable, "page.py"], cwd, timeout=timeout)


def exec_page(page: str, cwd: Path) -> dict:
    """Run ``docs/<page>``'s Python blocks in this process, in ``cwd``; their globals."""
    code = compile("\n".join(python_blocks(page)), str(DOCS / page), "exec")
    namespace = {"__name__": "__main__"}
    here = os.getcwd()
    os.chdir(cwd)
    try:
        exec(code, namespace)
    finally:
        os.chdir(here)
    return namespace
