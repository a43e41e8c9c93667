"""One save in a process of its own, for tests of concurrent saves into one path.

    python _save_proc.py SPEC_JSON

SPEC: {"url", "value", "storage_options", "options": {save kwargs}, "pause": dir or null,
"result": file}. With ``pause``, the save stops when its write phase begins (after its
claim), creates ``<pause>/paused`` and waits for ``<pause>/go``. The outcome is written
to ``result`` as JSON: {"ok": true} or {"ok": false, "types": [...], "message": ...}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(spec: dict) -> None:
    import torch

    import ucp_zarr
    import ucp_zarr.protocol.saver as saver

    if spec.get("pause"):
        pause = Path(spec["pause"])
        original = saver.PreparedSave._write_data

        def paused_write(self, *args, **kwargs):
            (pause / "paused").write_text(str(self.save_id))
            while not (pause / "go").exists():
                time.sleep(0.05)
            return original(self, *args, **kwargs)

        saver.PreparedSave._write_data = paused_write
    sd = {"w": torch.full((64, 256), float(spec["value"])), "b": torch.full((300,), float(spec["value"])), "step": spec["value"]}
    try:
        ucp_zarr.save(sd, spec["url"], storage_options=spec.get("storage_options"), chunk_bytes=8192, **spec.get("options", {}))
        out = {"ok": True}
    except Exception as e:  # reported to the test
        out = {"ok": False, "types": [c.__name__ for c in type(e).__mro__], "message": str(e)}
    Path(spec["result"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
