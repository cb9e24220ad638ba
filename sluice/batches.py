"""Anthropic Message Batches: their state, and the background task that runs them (sluice.background)."""
from __future__ import annotations


async def run(owner) -> None:
    """The background loop (nothing to run yet)."""
