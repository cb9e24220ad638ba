"""The pipeline's ceiling against HTTP streaming's: Sluice replaying a recorded gpt-oss output (no model
compute) on builtin:tiny-gpt-oss, beside the static granian SSE app streaming as many
same-size frames, under the same load.

    python -m bench.ceiling [--concurrencies 1,16,64,256] [--output-len 256] [--client-workers 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import httpx

from bench.serve import add_load_args, serve
from bench.server import ROOT, Server, free_port


def static_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "granian", "--interface", "asgi", "--workers", "1", "--loop",
                             "uvloop", "--port", str(port), "--log-level", "warning", "bench.static_sse:app"],
                            cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.post(url, json={"max_tokens": 1}, timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("the static SSE server did not start")


def harmony_recording(path: str, output_len: int) -> None:
    """A realistic gpt-oss output to replay: reasoning, then an answer, `output_len` tokens in all."""
    from sluice.harmony_vocab import harmony_encoding

    enc = harmony_encoding()
    words = enc.encode(" the river runs to the sea while the market opens and traders watch" * 40)
    head = enc.encode("<|channel|>analysis<|message|>", allowed_special="all")
    middle = enc.encode("<|end|><|start|>assistant<|channel|>final<|message|>", allowed_special="all")
    text = output_len - len(head) - len(middle) - 1
    tokens = head + words[: text // 2] + middle + words[: text - text // 2] + [200002]  # ... <|return|>
    with open(path, "w") as f:
        f.write(json.dumps(tokens) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_args(parser)
    parser.add_argument("--concurrencies", default="1,16,64,256")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--server-flags", nargs="*", default=[], help="extra `sluice serve` flags")
    args = parser.parse_args()
    args.model, args.ignore_eos, args.no_progress = "builtin:tiny-gpt-oss", True, True
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    rows: dict[str, dict[int, dict]] = {"sluice (replay)": {}, "granian static SSE": {}}
    recording = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    harmony_recording(recording, args.output_len)
    sluice = Server("--model", "builtin:tiny-gpt-oss", "--runner", "replay", "--replay-file", recording,
                    "--max-model-len", "4096", "--max-num-seqs", "512", *args.server_flags)
    try:
        for c in concurrencies:
            args.base_url, args.max_concurrency, args.num_prompts = sluice.url, c, max(64, 2 * c)
            rows["sluice (replay)"][c] = serve(args)
    finally:
        sluice.stop()
    proc, url = static_server()
    try:
        for c in concurrencies:
            args.base_url, args.max_concurrency, args.num_prompts = url, c, max(64, 2 * c)
            rows["granian static SSE"][c] = serve(args)
    finally:
        proc.terminate()
        proc.wait()
    print(f"{'server':22} {'conc':>5} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'tok/event':>9} {'ratio':>6}")
    for name, by_c in rows.items():
        for c, s in by_c.items():
            ratio = s["output_token_throughput"] / rows["granian static SSE"][c]["output_token_throughput"]
            print(f"{name:22} {c:>5} {s['output_token_throughput']:>10.0f} {s['ttft_ms']['median']:>9.1f} "
                  f"{s['ttft_ms']['p99']:>9.1f} {s['itl_ms']['median']:>8.2f} {s['itl_ms']['p99']:>8.2f} "
                  f"{s['tokens_per_event']:>9.2f} {ratio:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2, default=str)


if __name__ == "__main__":
    main()
