"""The pipeline's ceiling against HTTP streaming's, measured with a client that is not the bottleneck.

Sluice replays a recorded gpt-oss output (`--runner replay`: no model compute; rendering, scheduling,
KV accounting, harmony parsing and SSE framing run as in production) on builtin:tiny-gpt-oss; beside it,
granian serves bench/static_sse.py, a bare ASGI app that streams as many chat-chunk-sized events, one
`http.response.body` each. Both are driven by two clients in the same run:

- wrk (C, one thread) with bench/wrk_sse.lua, which posts the chat request and counts output events and
  tokens. While it runs, a few connections of the Python client (the "probe") time the events for ITL
  and TTFT; wrk sees whole responses only. Install wrk first:
      apt-get install -y wrk          # Debian / Ubuntu
      brew install wrk                # macOS
  or build it from https://github.com/wg/wrk. Without it, run with `--clients python`.
- the Python client (`sluice bench serve`'s load generator, --client-workers processes).

For every run it reports tokens/s, events/s (events with output), tokens per event, ITL p50/p99, and
CPU seconds per 1,000 tokens of each stage (from /proc/<pid>/stat) and of the client, with the client's
own ceiling: the events it can take per CPU second. Rounds interleave every server, so that a shared
machine's load falls on all of them alike; /proc/loadavg is printed with each run.

    python -m bench.ceiling [--concurrencies 64,256] [--frames coalesce,per-token] [--workers 1x1,2x2]
        [--clients wrk,python] [--rounds 2] [--duration 10] [--compare /path/to/other/tree]

--workers: ingress x postproc worker counts (the static server runs as many granian workers as the
ingress). --compare DIR: also run Sluice from the source tree DIR (e.g. `git archive` of an older
commit), as "before", interleaved with this tree's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

from bench.client import Connection, Result
from bench.faults import ppid
from bench.serve import _body, _stats, add_load_args, random_requests, serve
from bench.server import ROOT, Server, free_port

LUA = os.path.join(ROOT, "bench", "wrk_sse.lua")
MODEL = "builtin:tiny-gpt-oss"
ROLES = ("ingress", "render", "engine", "postproc", "other")
_TICK = os.sysconf("SC_CLK_TCK")
_FRAMES = {"coalesce": [], "per-token": ["--no-coalesce-frames"]}


def find_wrk() -> str:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("bench.ceiling: wrk is not installed. Install it (Debian / Ubuntu: `apt-get install -y wrk`; "
                         "macOS: `brew install wrk`; or build https://github.com/wg/wrk), or run with "
                         "`--clients python` to use the Python client alone.")
    return wrk


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads; 0 for one that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and ppid(int(p)) == pid]


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants (a server's stages and workers)."""
    return cpu_seconds(pid) + sum(tree_cpu(child) for child in children(pid))


def harmony_recording(path: str, output_len: int) -> None:
    """A realistic gpt-oss output to replay: reasoning, then an answer, `output_len` tokens in all."""
    from sluice.base.harmony_vocab import harmony_encoding

    enc = harmony_encoding()
    words = enc.encode(" the river runs to the sea while the market opens and traders watch" * 40)
    head = enc.encode("<|channel|>analysis<|message|>", allowed_special="all")
    middle = enc.encode("<|end|><|start|>assistant<|channel|>final<|message|>", allowed_special="all")
    text = output_len - len(head) - len(middle) - 1
    tokens = head + words[: text // 2] + middle + words[: text - text // 2] + [200002]  # ... <|return|>
    with open(path, "w") as f:
        f.write(json.dumps(tokens) + "\n")


# ---- the servers -------------------------------------------------------------------

class Static:
    """granian streaming bench/static_sse.py: HTTP streaming's own ceiling."""

    def __init__(self, workers: int) -> None:
        self.name, self.ingress = f"granian static x{workers}", workers
        port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "granian", "--interface", "asgi", "--workers", str(workers),
                                      "--loop", "uvloop", "--port", str(port), "--log-level", "warning",
                                      "bench.static_sse:app"], cwd=ROOT)
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                httpx.post(self.url, json={"max_tokens": 1}, timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError("the static SSE server did not start")

    def pids(self) -> dict[str, list[int]]:
        return {"ingress": [self.proc.pid, *children(self.proc.pid)]}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


class Sluice:
    def __init__(self, frames: str, ingress: int, postproc: int, recording: str, tree: str | None,
                 extra: list[str], variant: str = "") -> None:
        self.name = f"{'before' if tree else 'sluice'}{variant} {frames} {ingress}x{postproc}"
        self.ingress = ingress
        launcher = ("env", f"--chdir={tree}", f"PYTHONPATH={tree}") if tree else ()
        self.server = Server("--model", MODEL, "--runner", "replay", "--replay-file", recording, "--max-model-len",
                             "4096", "--max-num-seqs", "1024", "--num-kv-blocks", "65536", "--ingress-workers",
                             str(ingress), "--postproc-workers", str(postproc), *_FRAMES[frames], *extra,
                             launcher=launcher, port=free_port() if tree else 0)  # (an older tree: no --port 0)
        self.url = self.server.url

    def pids(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {role: [] for role in ROLES}
        log = self.server.output()
        for role, pid in re.findall(r"(\w+)\[\d+\] ready \(pid (\d+)\)", log):
            out[role if role in ROLES else "other"].append(int(pid))
        m = re.search(r"granian pid (\d+)", log)
        assert m is not None, "the supervisor logs granian's pid once the server is up"
        granian = int(m.group(1))
        out["ingress"] += [granian, *children(granian)]
        out["other"].append(self.server.proc.pid)
        return out

    def stop(self) -> None:
        self.server.stop()


# ---- the clients ---------------------------------------------------------------------

@dataclass
class Run:
    tokens: int
    events: int  # events with output
    seconds: float
    client_cpu: float
    itl_ms: dict[str, float]
    ttft_ms: float  # median
    errors: int = 0


def run_wrk(wrk: str, url: str, concurrency: int, args) -> Run:
    """wrk on all but --probe connections, the Python client timing events on those."""
    probes = min(args.probe, concurrency - 1)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0 = time.process_time()
    proc = subprocess.Popen([wrk, "-t1", f"-c{concurrency - probes}", f"-d{args.duration}s", "--timeout", "120s",
                             "-s", LUA, url, "--", MODEL, str(args.output_len), "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    probed = asyncio.run(_probe(url, probes, proc, args))
    out = proc.communicate()[0]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    m = re.search(r"^WRK_RESULT (.*)$", out, re.M)
    if m is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    w = json.loads(m.group(1))
    ok = [r for r in probed if r.ok]
    wrk_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Run(tokens=w["tokens"] + sum(r.output_tokens for r in ok),
               events=w["events"] + sum(len(r.gaps) + 1 for r in ok), seconds=w["duration_us"] / 1e6,
               client_cpu=wrk_cpu + time.process_time() - cpu0, itl_ms=_stats([g for r in ok for g in r.gaps]),
               ttft_ms=_stats([r.ttft for r in ok])["median"],
               errors=w["bad"] + sum(w["errors"].values()) + len(probed) - len(ok))


async def _probe(url: str, n: int, wrk: subprocess.Popen, args) -> list[Result]:
    """Back-to-back requests on `n` connections while wrk runs; those that ended before it did."""
    prompts = random_requests(64, args.input_len, args.output_len, 0.0, args.seed, None)
    done: list[Result] = []

    async def one(k: int) -> None:
        conn, rng = Connection(url), random.Random(k)
        while wrk.poll() is None:
            prompt, output_len = rng.choice(prompts)
            r = await conn.post_sse("/v1/chat/completions", _body(args, prompt, output_len))
            if wrk.poll() is None:
                done.append(r)

    await asyncio.gather(*(one(k) for k in range(n)))
    return done


def run_python(url: str, concurrency: int, args) -> Run:
    load = argparse.Namespace(**{**vars(args), "base_url": url, "max_concurrency": concurrency,
                                 "num_prompts": 4 * concurrency})
    s = serve(load)
    return Run(tokens=s["output_tokens"], events=round(s["output_tokens"] / s["tokens_per_event"]),
               seconds=s["duration_s"], client_cpu=s["client_cpu_s"], itl_ms=s["itl_ms"],
               ttft_ms=s["ttft_ms"]["median"], errors=s["requests"] - s["completed"])


# ---- measuring -----------------------------------------------------------------------

def measure(target, client: str, concurrency: int, args, wrk: str | None) -> dict:
    pids = target.pids()
    before = {role: sum(cpu_seconds(p) for p in ps) for role, ps in pids.items()}
    load = os.getloadavg()[0]
    run = run_wrk(wrk, target.url, concurrency, args) if wrk and client == "wrk" else \
        run_python(target.url, concurrency, args)
    after = {role: sum(cpu_seconds(p) for p in ps) for role, ps in pids.items()}
    per_k = 1000 / max(run.tokens, 1)
    return {"server": target.name, "ingress": target.ingress, "client": client, "concurrency": concurrency,
            "load": load, "tok_s": run.tokens / run.seconds, "events_s": run.events / run.seconds,
            "tok_event": run.tokens / max(run.events, 1), "ttft_p50": run.ttft_ms,
            "itl_p50": run.itl_ms["median"], "itl_p99": run.itl_ms["p99"],
            "cpu": {role: (after[role] - before[role]) * per_k for role in after},
            "client_cpu": run.client_cpu * per_k, "client_ceiling": run.events / max(run.client_cpu, 1e-9),
            "errors": run.errors}


_HEAD = (f"{'server':26} {'client':6} {'conc':>4} {'load':>5} {'tok/s':>8} {'events/s':>8} {'tok/ev':>6} "
         f"{'ITL p50':>7} {'ITL p99':>7} | CPU ms per 1k tokens: {'ingr':>5} {'rend':>5} {'eng':>5} {'post':>5} "
         f"{'other':>5} {'client':>6} | client ev/CPU-s")


def print_row(r: dict) -> None:
    c = r["cpu"]
    cpu = " ".join(f"{1000 * c.get(role, 0.0):5.1f}" for role in ROLES)
    print(f"{r['server']:26} {r['client']:6} {r['concurrency']:>4} {r['load']:5.1f} {r['tok_s']:8.0f} "
          f"{r['events_s']:8.0f} {r['tok_event']:6.2f} {r['itl_p50']:7.2f} {r['itl_p99']:7.2f} | "
          f"{'':21} {cpu} {1000 * r['client_cpu']:6.1f} | {r['client_ceiling']:9.0f}"
          + (f"  ERRORS {r['errors']}" if r["errors"] else ""), flush=True)


def print_summary(rows: list[dict]) -> None:
    """Means over the rounds, and each Sluice's ratios to the static server's events/s (same client,
    concurrency and ingress workers)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["client"], r["concurrency"], r["server"]), []).append(r)
    mean = {k: {f: sum(r[f] for r in v) / len(v) for f in ("tok_s", "events_s", "tok_event", "itl_p99", "load")}
            for k, v in groups.items()}
    print(f"\nmeans over the rounds\n{'client':6} {'conc':>4} {'server':26} {'tok/s':>8} {'events/s':>8} "
          f"{'tok/ev':>6} {'ITL p99':>7} {'load':>5} {'tok/s : static ev/s':>20} {'ev/s : static ev/s':>19}")
    for (client, conc, server), m in sorted(mean.items()):
        ingress = groups[(client, conc, server)][0]["ingress"]
        static = mean.get((client, conc, f"granian static x{ingress}"))
        ratios = f"{m['tok_s'] / static['events_s']:20.2f} {m['events_s'] / static['events_s']:19.2f}" if static else ""
        print(f"{client:6} {conc:>4} {server:26} {m['tok_s']:8.0f} {m['events_s']:8.0f} {m['tok_event']:6.2f} "
              f"{m['itl_p99']:7.2f} {m['load']:5.1f} {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_args(parser)
    parser.set_defaults(client_workers=2, warmup=8)
    parser.add_argument("--concurrencies", default="64,256")
    parser.add_argument("--clients", default="wrk,python", help="wrk, python, or both (comma-separated)")
    parser.add_argument("--frames", default="coalesce,per-token",
                        help="coalesce (the default server), per-token (--no-coalesce-frames), or both")
    parser.add_argument("--workers", default="1x1", help="ingress x postproc worker counts, e.g. 1x1,2x1,1x2,2x2")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--duration", type=int, default=10, help="seconds each wrk run lasts")
    parser.add_argument("--probe", type=int, default=2, help="Python connections timing events during wrk runs")
    parser.add_argument("--compare", metavar="DIR", help="also run Sluice from this source tree, as 'before'")
    parser.add_argument("--server-flags", nargs="*", default=[], help="extra `sluice serve` flags")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="also run this tree's Sluice with these extra flags, named NAME (repeatable)")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    args.model, args.ignore_eos, args.no_progress = MODEL, True, True
    clients = args.clients.split(",")
    wrk = find_wrk() if "wrk" in clients else None
    workers = [tuple(int(n) for n in w.split("x")) for w in args.workers.split(",")]
    recording = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    harmony_recording(recording, args.output_len)
    targets: list = []
    try:
        targets += [Static(n) for n in sorted({i for i, _ in workers})]
        variants: list[tuple[str | None, str, list[str]]] = [(os.path.abspath(args.compare), "", [])] \
            if args.compare else []
        variants.append((None, "", []))
        variants += [(None, f"[{name}]", flags.split()) for name, flags in (v.split("=", 1) for v in args.variant)]
        for tree, name, flags in variants:
            targets += [Sluice(frames, i, k, recording, tree, args.server_flags + flags, name)
                        for frames in args.frames.split(",") for i, k in workers]
        rows = []
        print(_HEAD)
        for _ in range(args.rounds):
            for c in (int(x) for x in args.concurrencies.split(",")):
                for client in clients:
                    for target in targets:
                        rows.append(measure(target, client, c, args, wrk))
                        print_row(rows[-1])
    finally:
        for target in targets:
            target.stop()
    print_summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
