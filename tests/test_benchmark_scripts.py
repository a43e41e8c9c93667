"""The scripts in ``benchmarks/`` still run against the library as it is: each imports (in a
subprocess: some import DeepSpeed), and the planning benchmark plans a small world end to end
(it builds the commit record as a save does, so a change of the saver's helpers shows here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def test_every_benchmark_script_imports():
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    code = "import importlib, sys; sys.path.insert(0, sys.argv[1])\nfor n in sys.argv[2:]: importlib.import_module(n)"
    done = subprocess.run([sys.executable, "-c", code, str(BENCH), *names], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_planning_benchmark_plans_a_small_world():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_planning as b\n"
            "r = b.measure(64, samples=2); assert r['objects'] > 0 and r['per_pair_max'] == 1 and r['read_x'] >= 1.0, r")
    done = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
