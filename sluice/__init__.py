"""Sluice: the CLI, configuration and supervisor."""

__version__ = "0.1.0"
