"""Issue 37: a request whose client leaves mid-stream is logged (and counted) with its own status, 499 as
nginx has it; and streams cut at --max-stream-buffer for clients that never read give their memory back."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from bench.faults import ingress_workers, rss_mb, stream_request
from tests.e2e.conftest import MODEL

GO = [{"role": "user", "content": "go"}]


def lines(server, words: str) -> list[str]:
    return [line for line in server.output().splitlines() if words in line]


def wait_for(check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_client_that_leaves_mid_stream_gets_a_request_log_line_with_status_499(server):
    before = len(lines(server, "client left"))
    body = {"model": MODEL, "messages": GO, "stream": True, "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_bytes())  # the stream began; the client leaves
    wait_for(lambda: len(lines(server, "client left")) > before)
    (line,) = lines(server, "client left")[before:]
    assert "route=/v1/chat/completions status=499" in line, line
    metrics = httpx.get(server.url + "/metrics").text
    assert 'sluice:requests_total{endpoint="/v1/chat/completions",status="499"}' in metrics


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_a_client_that_leaves_while_sending_its_body_is_logged_as_499(server, route):
    before = len(lines(server, f"route={route} status=499"))
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 1000\r\n\r\n{{\"model\": ".encode())
        time.sleep(0.2)  # (the ingress is reading the body when the client leaves)
    wait_for(lambda: len(lines(server, f"route={route} status=499")) > before, timeout=30)
    assert "client left" in lines(server, f"route={route} status=499")[-1]


def test_streams_cut_for_clients_that_never_read_give_their_memory_back(server):
    """Four clients that never read, each stream cut once the ingress holds --max-stream-buffer (4 MiB) for
    it: the ingress workers' memory goes back to within a quarter of what the streams took at their peak
    (it stayed 10-14 MB up for good: the frames, freed, stayed in glibc's heap)."""
    workers = ingress_workers(server)
    body = {"model": MODEL, "messages": GO, "stream": True, "n": 4, "max_tokens": 1500, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 20}
    cuts = len(lines(server, "response cut"))
    before = rss_mb(workers)
    clients = []
    for _ in range(4):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # the client's kernel buffers little
        s.connect(("127.0.0.1", server.port))
        s.sendall(stream_request(body))
        clients.append(s)
    peak = before
    try:
        deadline = time.monotonic() + 240
        while len(lines(server, "response cut")) < cuts + 4:
            assert time.monotonic() < deadline, "the streams were not cut"
            peak = max(peak, rss_mb(workers))
            time.sleep(0.1)
    finally:
        for s in clients:
            s.close()
    time.sleep(2)
    after = rss_mb(workers)
    assert peak - before > 8, (before, peak)  # the streams did hold their buffers
    assert after - before < (peak - before) / 4, {"before": before, "peak": peak, "after": after}
