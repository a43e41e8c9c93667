"""Draw docs/interval.png: the fraction of time lost to failures against the checkpoint
interval, from the model of :mod:`ucp_zarr.ops.interval` and from a seeded Monte-Carlo of the
same model, with the computed optima marked.

    python docs/make_interval_plot.py [OUT.png]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ucp_zarr.ops import expected_lost_fraction, optimal_interval, resolve_mtbf, simulate_lost_fraction

SAVE_COST_S = 60.0
RESTART_COST_S = 300.0
NODES, FAILURES_PER_NODE_DAY = 16, 0.25  # a job MTBF of 6 hours
SEED = 7


def main(out: str | Path = Path(__file__).with_name("interval.png")) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mtbf = resolve_mtbf(failures_per_node_day=FAILURES_PER_NODE_DAY, nodes=NODES)
    rate = {"failures_per_node_day": FAILURES_PER_NODE_DAY, "nodes": NODES}
    taus = np.geomspace(120.0, 4 * 3600.0, 200)
    model = [100 * expected_lost_fraction(t, SAVE_COST_S, restart_cost_s=RESTART_COST_S, **rate) for t in taus]
    rng = np.random.default_rng(SEED)
    sampled = np.geomspace(150.0, 3.5 * 3600.0, 14)
    simulated = [100 * simulate_lost_fraction(t, SAVE_COST_S, mtbf, restart_cost_s=RESTART_COST_S, segments=50_000, seed=rng) for t in sampled]

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    ax.plot(taus / 60, model, color="tab:blue", label="expected (model)")
    ax.plot(sampled / 60, simulated, "o", color="tab:gray", ms=4, label=f"Monte-Carlo (50k segments, seed {SEED})")
    for method, color, marker in (("young", "tab:orange", "s"), ("daly", "tab:red", "D")):
        tau = optimal_interval(SAVE_COST_S, restart_cost_s=RESTART_COST_S, method=method, **rate)
        lost = 100 * expected_lost_fraction(tau, SAVE_COST_S, restart_cost_s=RESTART_COST_S, **rate)
        ax.plot([tau / 60], [lost], marker, color=color, ms=8, label=f"{method.capitalize()}: {tau / 60:.1f} min, {lost:.2f} % lost")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (minutes of training between saves)")
    ax.set_ylabel("time lost (%)")
    ax.set_title(
        f"save {SAVE_COST_S:.0f} s, restart {RESTART_COST_S:.0f} s, {NODES} nodes x {FAILURES_PER_NODE_DAY} failures/node-day "
        f"(MTBF {mtbf / 3600:.0f} h)",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main(*sys.argv[1:]))
