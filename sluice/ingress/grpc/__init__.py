"""`sluice serve --grpc PORT`: the SGLang model gateway's worker protocol (server.py), for a router that
tokenizes and detokenizes itself."""
from __future__ import annotations

import socket

from sluice.base import ports

# The gpt-oss parser aliases (sluice/render/harmony.py): harmony's parsing runs in the postproc, which the door's
# token ids bypass; a router that speaks this protocol parses the output itself.
_GPT_OSS_PARSERS = ("gpt_oss", "openai_gptoss", "harmony")


def check_options(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """Refuses, at start, what --grpc cannot go with (in the words of trtllm-serve's --grpc), and a --grpc
    without the grpc extra installed."""
    try:
        import google.protobuf  # noqa: F401
        import grpc  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--grpc needs grpcio and protobuf ({e}): pip install 'sluice[grpc]'") from None
    for name, value in (("tool_parser", tool_parser), ("reasoning_parser", reasoning_parser)):
        if value in _GPT_OSS_PARSERS:
            raise ValueError(f"Argument '{name}' is not supported when running in gRPC mode. The gRPC server is "
                             "designed for use with external routers that handle these features (e.g., tool "
                             "parsing, chat templates).")


def hold_port(host: str, port: int | None) -> socket.socket | None:
    """The door's port, held by the supervisor for the server's life as the HTTP port is (sluice.base.ports.hold):
    the door binds it beside the hold, a restarted door the same port again (0: the one picked here)."""
    if port is None:
        return None
    try:
        return ports.hold(host, port)
    except OSError as e:
        raise ValueError(f"--grpc: cannot listen on {host}:{port}: {e.strerror}") from None
