"""The shared base under every stage: configuration and flags, environment, metrics, logs, process and port
helpers, checkpoints, and small helpers several stages share. It imports no stage."""
