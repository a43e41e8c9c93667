"""Execute the notebooks of ``notebooks/`` with nbclient, on a kernel of this interpreter.

The kernel is this interpreter's ipykernel, from a kernel spec written to a temporary
directory and given to the kernel manager alone: the notebooks run in this virtual
environment on any machine (nothing installed, no ``ipykernel install``, no other
environment's ``python3`` kernel picked up). Executions are cached per process, so the
notebook tests and the browser test share them.

``python tests/_notebooks.py [NAME ...]`` re-executes the notebooks in place (refreshing the
outputs kept in git), dropping outputs too large to keep.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = "ucp-zarr-tests"
MAX_OUTPUT_BYTES = 120_000
"""An output larger than this (serialised) is dropped from the copy kept in git."""


def _write_kernel_spec(kernels: Path) -> None:
    """A kernel spec :data:`KERNEL` in ``kernels``: this interpreter's ipykernel."""
    spec = kernels / KERNEL
    spec.mkdir(parents=True)
    spec.joinpath("kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})",
        "language": "python",
    }))


@functools.lru_cache(maxsize=None)
def execute(name: str, timeout_s: int = 300) -> tuple[nbformat.NotebookNode, float]:
    """The notebook ``notebooks/<name>`` executed top to bottom (cached), and its run time in
    seconds. Raises ``nbclient.exceptions.CellExecutionError`` on the first failing cell.

    The kernel's ``TMPDIR`` (where the notebooks write their checkpoints) is a temporary
    directory, removed afterwards."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    with tempfile.TemporaryDirectory(prefix="ucp_zarr_nb_") as tmp:
        _write_kernel_spec(Path(tmp, "kernels"))
        km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[f"{tmp}/kernels"]))
        client = NotebookClient(nb, km=km, timeout=timeout_s, resources={"metadata": {"path": str(NOTEBOOKS)}})
        t0 = time.perf_counter()
        client.execute(env=os.environ | {"TMPDIR": tmp})
        return nb, time.perf_counter() - t0


def kept(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of an executed notebook for git: outputs over :data:`MAX_OUTPUT_BYTES` dropped,
    execution timings removed, the kernel spec named ``python3``."""
    out = nbformat.from_dict(json.loads(json.dumps(nb)))
    for cell in out.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if len(json.dumps(o)) <= MAX_OUTPUT_BYTES]
    out.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return out


def main(names: list[str]) -> None:
    for name in names or sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")):
        nb, seconds = execute(name)
        nbformat.write(kept(nb), NOTEBOOKS / name)
        print(f"{name}: {seconds:.1f} s, {(NOTEBOOKS / name).stat().st_size:,} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
