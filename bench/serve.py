"""`sluice bench serve`: load any OpenAI-compatible server and report throughput and latency.

    sluice bench serve --base-url http://127.0.0.1:8000 --model builtin:tiny-chat \\
        --dataset random --input-len 100 --output-len 256 --num-prompts 256 --max-concurrency 64
    sluice bench sweep --concurrencies 1,16,64 --out sweep/ ...   # one JSON each, and sweep.png

TTFT is to the first event with output; ITL is the gap between such events; TPOT is
(e2e - TTFT) / (output tokens - 1), with token counts from the server's usage.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from bench.client import Connection, Result

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river market letter mountain science answer").split()


# ---- datasets ---------------------------------------------------------------------

def random_requests(n: int, input_len: int, output_len: int, ratio: float, seed: int,
                    tokenizer: str | None) -> list[tuple[str, int]]:
    """(prompt text, output tokens) pairs with lengths uniform in [len*(1-ratio), len*(1+ratio)]."""
    rng = random.Random(seed)
    tok = None
    if tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json") if Path(tokenizer).is_dir() else tokenizer)
    out = []
    for _ in range(n):
        lo, hi = int(input_len * (1 - ratio)), int(input_len * (1 + ratio))
        want = max(1, rng.randint(max(lo, 1), max(hi, 1)))
        if tok is not None:  # random ids decoded, as vLLM's random dataset does
            ids = [rng.randrange(tok.get_vocab_size()) for _ in range(want)]
            text = tok.decode(ids)
        else:
            text = " ".join(rng.choice(WORDS) for _ in range(want))  # about one token a word
        olo, ohi = int(output_len * (1 - ratio)), int(output_len * (1 + ratio))
        out.append((text, max(1, rng.randint(max(olo, 1), max(ohi, 1)))))
    return out


def file_requests(kind: str, path: str, n: int, output_len: int, seed: int) -> list[tuple[str, int]]:
    rows = []
    if kind == "sharegpt":
        for item in json.loads(Path(path).read_text()):
            turns = item.get("conversations") or []
            if len(turns) >= 2:
                rows.append((turns[0]["value"], max(1, len(turns[1]["value"].split()))))
    else:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                rows.append((item["prompt"], int(item.get("output_len", output_len))))
    random.Random(seed).shuffle(rows)
    if not rows:
        raise SystemExit(f"{path}: no prompts")
    return (rows * (n // len(rows) + 1))[:n]


# ---- load ---------------------------------------------------------------------------

def _body(args, prompt: str, output_len: int) -> dict:
    body = {"model": args.model, "max_tokens": output_len, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _drive(args, requests: list[tuple[str, int]], concurrency: int, rate: float, seed: int,
                 progress) -> list[Result]:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    pool = [Connection(args.base_url, args.api_key) for _ in range(concurrency)]
    free: asyncio.Queue = asyncio.Queue()
    for c in pool:
        free.put_nowait(c)
    rng = random.Random(seed)
    results: list[Result] = []

    async def one(prompt: str, output_len: int) -> None:
        conn = await free.get()
        try:
            results.append(await conn.post_sse(path, _body(args, prompt, output_len)))
        finally:
            free.put_nowait(conn)
            if progress is not None:
                with progress.get_lock():
                    progress.value += 1

    tasks = []
    for prompt, output_len in requests:
        tasks.append(asyncio.create_task(one(prompt, output_len)))
        if rate != float("inf"):  # Poisson arrivals; burstiness < 1 is burstier, > 1 steadier
            await asyncio.sleep(rng.gammavariate(args.burstiness, 1.0 / (rate * args.burstiness)))
    await asyncio.gather(*tasks)
    return results


def _worker(args, requests, concurrency, rate, seed, progress, out, start) -> None:
    start.wait()  # every client process is up: the clock starts now, not at their spawn
    cpu = time.process_time()
    results = asyncio.run(_drive(args, requests, concurrency, rate, seed, progress))
    out.put(([r.__dict__ for r in results], time.perf_counter(), time.process_time() - cpu))


_CLIENT_START_S = 120


def run_load(args, requests: list[tuple[str, int]]) -> tuple[list[Result], float, float]:
    """Runs the load over --client-workers processes; returns every result, the wall time, from the
    first request sent to the last one finished (the client processes' start-up, ~0.2 s each, is not in
    it: in a short run it would shrink every ratio between two servers toward 1), and the CPU seconds the
    client processes spent in that time."""
    w = max(1, min(args.client_workers, args.max_concurrency))
    ctx = mp.get_context("spawn")
    progress, out, start = ctx.Value("i", 0), ctx.Queue(), ctx.Barrier(w + 1)
    shares = [requests[i::w] for i in range(w)]
    conc = [args.max_concurrency // w + (i < args.max_concurrency % w) for i in range(w)]
    procs = [ctx.Process(target=_worker, args=(args, shares[i], conc[i], args.request_rate / w, args.seed + i,
                                               progress, out, start)) for i in range(w)]
    for p in procs:
        p.start()
    try:
        start.wait(timeout=_CLIENT_START_S)
    except threading.BrokenBarrierError:
        for p in procs:
            p.kill()
        raise SystemExit(f"the client processes did not start within {_CLIENT_START_S} s") from None
    t0 = time.perf_counter()  # perf_counter is CLOCK_MONOTONIC on Linux: the same clock in every process
    results: list[Result] = []
    ends: list[float] = []
    cpu = 0.0
    while len(ends) < w:
        try:
            rows, end, used = out.get(timeout=0.5)
            results += [Result(**r) for r in rows]
            ends.append(end)
            cpu += used
        except queue.Empty:
            if sum(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit("a client process failed; see its traceback above")
        if not args.no_progress:
            n = progress.value
            bar = "#" * int(30 * n / len(requests))
            print(f"\r[{bar:<30}] {n}/{len(requests)}", end="", file=sys.stderr, flush=True)
    wall = max(ends) - t0
    for p in procs:
        p.join()
    if not args.no_progress:
        print(file=sys.stderr)
    return results, wall, cpu


# ---- report ---------------------------------------------------------------------------

def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(values)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] * 1000  # noqa: E731
    return {"mean": statistics.mean(s) * 1000, "median": statistics.median(s) * 1000, "p90": pick(0.9),
            "p99": pick(0.99)}


def summarize(results: list[Result], wall: float, goodput: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    good = [r for r in ok if r.ttft * 1000 <= goodput.get("ttft", float("inf")) and (
        r.output_tokens < 2 or (r.e2e - r.ttft) / (r.output_tokens - 1) * 1000 <= goodput.get("tpot", float("inf")))]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "no output"] = errors.get(r.error or "no output", 0) + 1
    return {
        "requests": len(results), "completed": len(ok), "errors": errors, "duration_s": wall,
        "request_throughput": len(ok) / wall, "output_token_throughput": out_tokens / wall,
        "total_token_throughput": (in_tokens + out_tokens) / wall, "prompt_tokens": in_tokens,
        "output_tokens": out_tokens, "goodput_requests_per_s": len(good) / wall if goodput else None,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for r in ok for g in r.gaps]), "e2e_ms": _stats([r.e2e for r in ok]),
        # above 1: the server sent several tokens in some events (--stream-interval, or merging under load)
        "tokens_per_event": out_tokens / max(1, sum(len(r.gaps) + 1 for r in ok)),
    }


def print_summary(s: dict) -> None:
    print(f"requests {s['completed']}/{s['requests']} in {s['duration_s']:.2f}s; errors {s['errors'] or 'none'}")
    print(f"request throughput {s['request_throughput']:.2f}/s, output {s['output_token_throughput']:.1f} tok/s, "
          f"total {s['total_token_throughput']:.1f} tok/s, {s['tokens_per_event']:.2f} tokens per event")
    if s["goodput_requests_per_s"] is not None:
        print(f"goodput {s['goodput_requests_per_s']:.2f} req/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        print(f"{key[:-3].upper():5} mean {v['mean']:9.2f}  median {v['median']:9.2f}  p90 {v['p90']:9.2f}  "
              f"p99 {v['p99']:9.2f} ms")


# ---- CLI --------------------------------------------------------------------------------

def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="builtin:tiny-chat")
    p.add_argument("--api-key")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--dataset", nargs="+", default=["random"], metavar="KIND [FILE]",
                   help="random | sharegpt FILE | jsonl FILE")
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--tokenizer", help="tokenizer.json (or its directory) for exact random prompt lengths")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="requests sent (and not counted) first")
    p.add_argument("--goodput", nargs="*", default=[], metavar="SLO:MS", help="e.g. ttft:500 tpot:50")
    p.add_argument("--client-workers", type=int, default=1, help="client processes (the client must not bottleneck)")
    p.add_argument("--no-progress", action="store_true")


def serve(args) -> dict:
    kind = args.dataset[0]
    if kind == "random":
        requests = random_requests(args.num_prompts + args.warmup, args.input_len, args.output_len, args.range_ratio,
                                   args.seed, args.tokenizer)
    else:
        requests = file_requests(kind, args.dataset[1], args.num_prompts + args.warmup, args.output_len, args.seed)
    if args.warmup:
        warm = argparse.Namespace(**{**vars(args), "client_workers": 1, "max_concurrency": args.warmup,
                                     "request_rate": float("inf"), "no_progress": True})
        run_load(warm, requests[: args.warmup])
    goodput = {k: float(v) for k, v in (g.split(":") for g in args.goodput)}
    results, wall, cpu = run_load(args, requests[args.warmup:])
    summary = summarize(results, wall, goodput)
    summary["client_cpu_s"] = cpu
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sluice bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="one load run")
    add_load_args(s)
    s.add_argument("--json", help="write the result here")
    w = sub.add_parser("sweep", help="serve at several concurrencies and plot throughput against latency")
    add_load_args(w)
    w.add_argument("--concurrencies", default="1,16,64")
    w.add_argument("--out", default="bench-sweep")
    args = parser.parse_args(argv)
    if args.command == "serve":
        summary = serve(args)
        print_summary(summary)
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = []
    for c in (int(x) for x in args.concurrencies.split(",")):
        args.max_concurrency = c
        summary = serve(args)
        print(f"--- concurrency {c}")
        print_summary(summary)
        (out / f"c{c}.json").write_text(json.dumps(summary, indent=2, default=str))
        points.append((c, summary))
    plot(points, out / "sweep.png")
    print(f"wrote {out}/sweep.png")


def plot(points: list[tuple[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [s["tpot_ms"]["median"] for _, s in points]
    ys = [s["output_token_throughput"] for _, s in points]
    ax.plot(xs, ys, marker="o")
    for (c, _), x, y in zip(points, xs, ys):
        ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("TPOT median (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs latency")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
