"""The package version, importable by every layer (it is written into each manifest)."""

__version__ = "0.1.0"
