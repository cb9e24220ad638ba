"""The application on top: the CLI, the supervisor that starts every stage, the background owner, and the
built-in checkpoints."""
