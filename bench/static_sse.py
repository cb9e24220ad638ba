"""A trivial granian ASGI app that streams N same-size SSE frames per request, shaped like
Sluice's chat chunks: the ceiling of HTTP streaming on this machine (and of the load client).

    python -m granian --interface asgi --workers 1 --port 8100 bench.static_sse:app
"""
from __future__ import annotations

import json

_CHUNK = (b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"m","choices":'
          b'[{"index":0,"delta":{"content":"tok"},"finish_reason":null,"logprobs":null}],"usage":null}\n\n')
_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    n = int(json.loads(body or b"{}").get("max_tokens", 16))
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    for _ in range(n):
        await send({"type": "http.response.body", "body": _CHUNK, "more_body": True})
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n,
                                                 "total_tokens": n + 1}}).encode()
    await send({"type": "http.response.body", "body": b"data: " + usage + b"\n\ndata: [DONE]\n\n"})
