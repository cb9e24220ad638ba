"""Stored and background responses (the Responses API): their state, and the background task that runs the
background ones (sluice.background)."""
from __future__ import annotations


async def run(owner) -> None:
    """The background loop (nothing to run yet)."""
