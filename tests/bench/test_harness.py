"""The load generator runs, and its numbers agree with the server's (no timing assertions)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from bench.serve import add_load_args, plot, serve
from bench.server import ROOT
from sluice.engine.cpu.build import cpu_flags
from tests.e2e.conftest import MODEL


def _args(base_url: str, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_load_args(parser)
    args = parser.parse_args(["--base-url", base_url, "--model", MODEL, "--no-progress"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_counts_agree_with_the_server(server):
    before = server.metrics()["sluice:generation_tokens_total"]
    s = serve(_args(server.url, num_prompts=24, max_concurrency=6, output_len=12, input_len=20, ignore_eos=True,
                    warmup=2, client_workers=2, goodput=["ttft:100000", "tpot:100000"]))
    assert (s["requests"], s["completed"], s["errors"]) == (24, 24, {})
    assert s["output_tokens"] == 24 * 12
    assert server.metrics()["sluice:generation_tokens_total"] - before == (24 + 2) * 12  # + the warm-up
    assert s["goodput_requests_per_s"] == s["request_throughput"]  # SLOs nobody misses
    assert 1 <= s["tokens_per_event"] <= 12  # each event with output carries at least one token
    assert s["ttft_ms"]["median"] > 0 and s["tpot_ms"]["median"] > 0 and s["e2e_ms"]["p99"] >= s["e2e_ms"]["median"]


def test_completions_poisson_arrivals_and_errors(server):
    s = serve(_args(server.url, endpoint="completions", num_prompts=10, max_concurrency=4, output_len=5,
                    request_rate=50.0, ignore_eos=True, warmup=0, seed=3))
    assert s["completed"] == 10 and s["output_tokens"] == 50
    bad = serve(_args(server.url, model="nope", num_prompts=3, max_concurrency=3, warmup=0))
    assert bad["completed"] == 0 and bad["errors"] == {"http 404": 3}


def test_datasets_and_sweep_plot(server, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"hello {i}", "output_len": 3}) for i in range(4)))
    s = serve(_args(server.url, dataset=["jsonl", str(data)], num_prompts=8, max_concurrency=2, ignore_eos=True,
                    warmup=0))
    assert s["completed"] == 8 and s["output_tokens"] == 24
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi there"},
                                                       {"from": "gpt", "value": "one two three"}]}]))
    s = serve(_args(server.url, dataset=["sharegpt", str(sharegpt)], num_prompts=2, max_concurrency=2,
                    ignore_eos=True, warmup=0))
    assert s["output_tokens"] == 6
    plot([(1, s), (2, s)], tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_the_cli(server, tmp_path):
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "sluice", "bench", "serve", "--base-url", server.url, "--model", MODEL,
                    "--num-prompts", "4", "--max-concurrency", "2", "--output-len", "3", "--ignore-eos",
                    "--no-progress", "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=120)
    assert json.loads(out.read_text())["output_tokens"] == 12


def test_kernel_ab_compares_two_builds_call_by_call():
    """bench.kernel_ab against this same tree: both builds load, every product is bit-equal, attention too."""
    if not {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        pytest.skip("this CPU lacks AVX-512F/BW/VL (the float32 kernels bench.kernel_ab compares)")
    out = subprocess.run([sys.executable, "-m", "bench.kernel_ab", "--base", str(ROOT), "--linears", "128x64",
                          "--rows", "1,30", "--causal", "2/1x16", "--tokens", "40", "--calls", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout.splitlines()
    rows = [line for line in out if "this/base" in line]
    assert len(rows) == 5 and all(line.endswith("bit-equal") for line in rows), out  # linear, SwiGLU x 2 rows; causal
