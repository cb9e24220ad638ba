"""The anthropic dialect's framer (registered in postproc.framers.FRAMERS)."""
