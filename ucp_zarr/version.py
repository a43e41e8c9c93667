"""The library version (its own module, so that no module imports the package init)."""

__version__ = "0.2.0"
