"""The responses dialect's framer (registered in postproc.framers.FRAMERS)."""
