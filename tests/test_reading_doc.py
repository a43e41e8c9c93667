"""docs/reading.md is true: its code blocks run, in order, in a process that cannot import
ucp_zarr, against a checkpoint saved by ucp_zarr, and read the right values."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_other_readers import BLOCK_UCP_ZARR

import ucp_zarr

DOC = Path(__file__).parent.parent / "docs" / "reading.md"

pytest.importorskip("xarray")
pytest.importorskip("tensorstore")


def test_reading_doc_blocks_run_without_ucp_zarr(tmp_path: Path) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 64).to(torch.bfloat16)
    opt = torch.optim.AdamW({"layers.0.weight": layer.weight, "layers.0.bias": layer.bias}.items())
    layer(torch.randn(4, 32, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    state = {"model": {"layers.0.weight": layer.weight.detach(), "layers.0.bias": layer.bias.detach()},
             "optim": opt.state_dict()}
    ucp_zarr.save(state, tmp_path / "ckpt")
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 5
    np.save(tmp_path / "want.npy", layer.weight.detach().float().numpy())
    check = (  # after each block that reads the weights into `w`: they are the right values
        "import numpy as _np\n"
        f"_want = _np.load({str(tmp_path / 'want.npy')!r})\n"
        "assert _np.array_equal(_np.asarray(w).astype('float32'), _want[: len(w)])\n"
    )
    script = BLOCK_UCP_ZARR + "\n".join(b + (check if "\nw = " in "\n" + b else "") for b in blocks)
    script += "\nimport sys\nassert 'ucp_zarr' not in sys.modules\nprint('OK')\n"
    (tmp_path / "doc.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "doc.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]
