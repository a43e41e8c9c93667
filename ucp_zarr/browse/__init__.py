"""Browsing checkpoints: torch-free listings, statistics and diffs, training runs, and their Jupyter HTML and plots."""
