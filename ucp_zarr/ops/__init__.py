"""Checkpointing as an operation: the checkpoint manager, the optimal interval, step listings.

Importing this package does not import torch (``ucp-zarr ls`` lists steps without it); the
manager imports it when created.
"""

from .interval import (
    daly_interval,
    exact_interval,
    expected_lost_fraction,
    optimal_interval,
    resolve_mtbf,
    simulate_lost_fraction,
    young_interval,
)
from .manager import CheckpointManager, SaveMetrics
from .retention import steps_to_delete
from .steps import StepGoneError, StepInfo, list_steps, parse_step, step_name

__all__ = [
    "CheckpointManager",
    "SaveMetrics",
    "StepGoneError",
    "StepInfo",
    "daly_interval",
    "exact_interval",
    "expected_lost_fraction",
    "list_steps",
    "optimal_interval",
    "parse_step",
    "resolve_mtbf",
    "simulate_lost_fraction",
    "step_name",
    "steps_to_delete",
    "young_interval",
]
