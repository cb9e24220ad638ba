"""The render pool: the shared chat core that turns any dialect's request into
prompt token ids, sampling params and a postproc spec."""
