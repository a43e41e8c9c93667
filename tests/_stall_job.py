"""A saving process for the stalled-writer trials (tests/test_stalled_writer.py).

    python _stall_job.py LEASE_S

Reads ``PATH VALUE STOP_AT`` lines on stdin; for each, saves a state of many small shards
(each write slowed by a few milliseconds, so that a stop from outside lands anywhere in the
save) and prints one JSON line: {"ok": true} or {"ok": false, "error": "<class>: <message>"}.
With ``STOP_AT`` >= 0 the process stops itself (SIGSTOP) right before writing its
``STOP_AT``-th shard: after the fence let the write go on, the narrowest window there is.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main(lease_s: float) -> None:
    import torch

    import ucp_zarr
    import ucp_zarr.protocol.saver as saver

    torch.set_num_threads(1)
    original = saver.write_shard
    shards = {"n": 0, "stop_at": -1}

    def slow(*args, **kwargs):
        if shards["n"] == shards["stop_at"]:
            os.kill(os.getpid(), signal.SIGSTOP)
        shards["n"] += 1
        time.sleep(0.008)
        return original(*args, **kwargs)

    saver.write_shard = slow
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        path, value, stop_at = line.split()
        shards.update(n=0, stop_at=int(stop_at))
        state = {f"t{i}": torch.full((32, 64), float(value)) for i in range(8)}
        state["step"] = int(float(value))
        try:
            ucp_zarr.save(state, path, lease_s=lease_s, chunk_bytes=1024, shard_bytes=1024, max_workers=1)
            out = {"ok": True}
        except Exception as e:  # reported to the test
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]))
