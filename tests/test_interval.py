"""The interval advisor: closed forms, argument checks, and a Monte-Carlo of random failures."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ucp_zarr.ops import (
    daly_interval,
    exact_interval,
    expected_lost_fraction,
    optimal_interval,
    resolve_mtbf,
    simulate_lost_fraction,
    young_interval,
)


def test_closed_forms():
    c, m = 60.0, 3600.0
    young = math.sqrt(2 * c * m)
    assert optimal_interval(c, m, method="young") == pytest.approx(young, rel=1e-12)
    daly = young * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    assert optimal_interval(c, m) == pytest.approx(daly, rel=1e-12)
    assert optimal_interval(c, m, method="daly") == daly_interval(c, m)
    assert young_interval(c, m) == optimal_interval(c, m, method="young")
    # Daly's estimate beyond C >= 2M: save once per MTBF
    assert optimal_interval(7200.0, 3600.0) == 3600.0
    assert optimal_interval(9000.0, 3600.0) == 3600.0
    # the failure rate per node-day: 2 nodes failing once a day each fail every 12 h together
    assert optimal_interval(c, failures_per_node_day=1.0, nodes=2) == pytest.approx(daly_interval(c, 43200.0))
    assert resolve_mtbf(failures_per_node_day=0.5, nodes=4) == pytest.approx(43200.0)
    # the restart cost moves no optimum of the exponential model; it scales the lost time
    assert optimal_interval(c, m, restart_cost_s=600.0) == optimal_interval(c, m)
    assert expected_lost_fraction(daly, c, m, restart_cost_s=600.0) > expected_lost_fraction(daly, c, m)


@pytest.mark.parametrize("ratio", [1e-4, 1e-2, 0.1, 0.5, 1.0, 1.9])
def test_exact_optimum_is_the_minimum_and_daly_is_close(ratio):
    m = 3600.0
    c = ratio * m
    tau = exact_interval(c, m)
    lost = expected_lost_fraction(tau, c, m)
    for other in (tau * 0.98, tau * 1.02):  # a true minimum
        assert expected_lost_fraction(other, c, m) > lost
    assert expected_lost_fraction(daly_interval(c, m), c, m) <= lost * (1 + 1e-4)
    assert expected_lost_fraction(young_interval(c, m), c, m) <= lost * 1.025
    # first order: about sqrt(2C/M) of the time is lost at the optimum when C << M
    if ratio <= 1e-2:
        assert lost == pytest.approx(math.sqrt(2 * ratio), rel=0.1)


def test_lost_fraction_formula():
    tau, c, m, r = 500.0, 30.0, 2000.0, 100.0
    want = 1 - tau / (m * math.exp(r / m) * (math.exp((tau + c) / m) - 1))
    assert expected_lost_fraction(tau, c, m, restart_cost_s=r) == pytest.approx(want, rel=1e-12)
    assert expected_lost_fraction(1e9, c, m) == 1.0  # no progress at all


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"save_cost_s": 10.0}, "give the failure rate"),
        ({"save_cost_s": 10.0, "mtbf_s": 100.0, "failures_per_node_day": 1.0, "nodes": 2}, "not both"),
        ({"save_cost_s": 10.0, "failures_per_node_day": 1.0}, "nodes is missing"),
        ({"save_cost_s": 10.0, "nodes": 8}, "failures_per_node_day is missing"),
        ({"save_cost_s": 10.0, "failures_per_node_day": 1.0, "nodes": 0}, "nodes must be a positive integer"),
        ({"save_cost_s": 10.0, "failures_per_node_day": 1.0, "nodes": 2.5}, "nodes must be a positive integer"),
        ({"save_cost_s": 0.0, "mtbf_s": 100.0}, "save_cost_s must be finite and > 0"),
        ({"save_cost_s": -1.0, "mtbf_s": 100.0}, "save_cost_s"),
        ({"save_cost_s": 1.0, "mtbf_s": math.inf}, "mtbf_s must be finite"),
        ({"save_cost_s": math.nan, "mtbf_s": 100.0}, "save_cost_s"),
        ({"save_cost_s": 1.0, "mtbf_s": 100.0, "restart_cost_s": -5.0}, "restart_cost_s must be finite and >= 0"),
        ({"save_cost_s": 1.0, "mtbf_s": 100.0, "method": "guess"}, "method must be one of"),
        ({"save_cost_s": 1.0, "failures_per_node_day": -2.0, "nodes": 3}, "failures_per_node_day must be finite"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimal_interval(**kwargs)


def test_bad_argument_types():
    with pytest.raises(TypeError, match="save_cost_s"):
        optimal_interval("10", 100.0)
    with pytest.raises(TypeError, match="mtbf_s"):
        optimal_interval(10.0, True)


def test_monte_carlo_agrees_with_the_chosen_interval():
    """Simulated lost time (exponential failures, seeded) at the interval optimal_interval
    chooses is within 2 % of the best interval a grid search over simulations finds."""
    c, m, r = 60.0, 3600.0, 120.0
    seed = 20261203
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    chosen = optimal_interval(c, m, restart_cost_s=r)
    grid = np.linspace(0.25, 3.0, 23) * chosen
    simulated = [simulate_lost_fraction(t, c, m, restart_cost_s=r, segments=100_000, seed=rng) for t in grid]
    best = int(np.argmin(simulated))
    at_chosen = simulate_lost_fraction(chosen, c, m, restart_cost_s=r, segments=400_000, seed=rng)
    print(f"chosen {chosen:.0f} s: lost {at_chosen:.4f}; best of grid {grid[best]:.0f} s: lost {simulated[best]:.4f}")
    assert 0 < best < len(grid) - 1  # the grid brackets the optimum
    assert at_chosen <= simulated[best] * 1.02
    # and the simulation reproduces the model
    for t, s in zip(grid[::5], simulated[::5]):
        assert s == pytest.approx(expected_lost_fraction(t, c, m, restart_cost_s=r), rel=0.03)
    # a poorly chosen interval loses measurably more
    assert simulated[0] > at_chosen * 1.1 and simulated[-1] > at_chosen * 1.1


def test_interval_plot(tmp_path):
    """docs/make_interval_plot.py draws the lost-time curve with the optima marked."""
    pytest.importorskip("matplotlib")
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parents[1] / "docs" / "make_interval_plot.py"
    spec = importlib.util.spec_from_file_location("make_interval_plot", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(tmp_path / "interval.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
