"""Sluice: an OpenAI- and Anthropic-compatible LLM server built as a multi-process pipeline.

Layers, each importing only from itself and below (tests/test_lint.py checks it):
  sluice.schemas   the HTTP schemas of the dialects (OpenAI, Anthropic, Responses), their error shapes, the SDK fields
  sluice.ipc       what crosses a process boundary: messages, codec, transports, shared memory
  sluice.base      configuration, flags, environment, metrics, logs, process helpers, checkpoints
  sluice.state     the SQLite state under --state-dir: batches, stored responses, stored chat completions
  sluice.render, sluice.engine, sluice.postproc   the stages
  sluice.ingress   the HTTP front
  sluice.router, sluice.app   on top: the router, the CLI, the supervisor, the background owner, built-in models
"""

__version__ = "0.1.0"
