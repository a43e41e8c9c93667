"""Pure, I/O-free layout math: boxes, chunk grids, flat ranges."""

from .boxes import Box, grid_indices
from .chunking import ChunkGrid, choose_grid

__all__ = ["Box", "ChunkGrid", "choose_grid", "grid_indices"]
