"""The responses dialect's translation into the chat core's request (registered with render.dialects.translator)."""
