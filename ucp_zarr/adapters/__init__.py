"""Adapters at the edges: DTensor/FSDP2 placements, torch DCP."""
