"""Metrics across processes, per-request timings, structured request logs."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from bench.server import Server
from tests.e2e.conftest import MODEL


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    timing = tmp_path_factory.mktemp("timing") / "kv.jsonl"
    s = Server("--ingress-workers", "2", "--postproc-workers", "2", "--perf-metrics", "--kv-timing-output",
               str(timing), "--log-format", "json")
    s.timing_file = timing
    yield s
    assert s.stop() == 0


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if m := re.match(r"^([a-z0-9_:]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line):
            out[m.group(1)] = float(m.group(2))
    return out


def test_perf_metrics_timing_file_and_logs(observed):
    client = openai.OpenAI(base_url=observed.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       extra_body={"ignore_eos": True})
    perf = r.model_extra["perf_metrics"]
    order = ["arrival_time", "render_done_time", "first_scheduled_time", "first_token_time", "last_token_time"]
    assert [perf[k] for k in order] == sorted(perf[k] for k in order) and perf["arrival_time"] > 1e9
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].model_extra["perf_metrics"]["last_token_time"] >= chunks[-1].model_extra["perf_metrics"][
        "first_token_time"]
    assert "perf_metrics" not in chunks[0].model_extra
    lines = [json.loads(line) for line in observed.timing_file.read_text().splitlines()]
    mine = next(x for x in lines if x["request_id"] == r.id)
    assert (mine["prompt_tokens"], mine["completion_tokens"], mine["finish_reasons"]) == (
        r.usage.prompt_tokens, 5, ["length"])
    logged = [json.loads(line) for line in observed.output().splitlines() if line.startswith("{")]
    done = [x for x in logged if x["msg"] == "request done" and x.get("request_id") == r.id]
    assert done and done[0]["stage"].startswith("postproc[") and done[0]["completion_tokens"] == 5


def test_metrics_aggregate_every_process(observed):
    before = _samples(httpx.get(observed.url + "/metrics").text)
    for i in range(10):  # spread over both ingress workers and both postproc shards
        assert httpx.post(observed.url + "/v1/completions",
                          json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 2,
                                "ignore_eos": True}).status_code == 200
    assert httpx.post(observed.url + "/v1/completions", json={"model": MODEL, "prompt": 5}).status_code == 400
    after = _samples(httpx.get(observed.url + "/metrics").text)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta('sluice:requests_total{endpoint="/v1/completions",status="200"}') == 10
    assert delta('sluice:requests_total{endpoint="/v1/completions",status="400"}') == 1
    assert delta('sluice:request_success_total{finished_reason="length"}') == 10
    assert delta("sluice:time_to_first_token_seconds_count") == 10
    assert delta("sluice:inter_token_latency_seconds_count") == 10  # one gap each: two tokens
    assert delta("sluice:e2e_request_latency_seconds_count") == 10
    for name in ("queue", "prefill", "decode"):
        assert delta(f"sluice:request_{name}_time_seconds_count") == 10
    assert delta("sluice:generation_tokens_finished_total") == 20
    for gauge in ("sluice:num_requests_running", "sluice:kv_cache_usage_perc", "sluice:prefix_cache_hit_rate",
                  'sluice:stage_requests_in_flight{stage="ingress"}', 'sluice:stage_requests_in_flight{stage="render"}',
                  'sluice:stage_requests_in_flight{stage="postproc"}'):
        assert gauge in after, gauge
