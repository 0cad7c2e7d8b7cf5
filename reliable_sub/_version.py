"""The package version (a module of its own: the core imports it without a cycle)."""

__version__ = "0.1.0"
