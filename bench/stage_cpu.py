"""CPU seconds per 1,000 streamed tokens for each stage, and a py-spy profile of the busiest.

    python -m bench.stage_cpu [--concurrency 64] [--output-len 256] [--profile out.txt]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import tempfile

from bench.ceiling import cpu_seconds, harmony_recording
from bench.faults import ingress_workers
from bench.serve import add_load_args, serve
from bench.server import Server


def stage_pids(server: Server) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for role, pid in re.findall(r"(\w+)\[\d+\] ready \(pid (\d+)\)", server.output()):
        out.setdefault(role, []).append(int(pid))
    out["ingress"] = ingress_workers(server)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_args(parser)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--profile", help="write a py-spy profile of the busiest stage here")
    parser.add_argument("--server-flags", nargs="*", default=[])
    args = parser.parse_args()
    recording = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    harmony_recording(recording, args.output_len)
    server = Server("--model", "builtin:tiny-gpt-oss", "--runner", "replay", "--replay-file", recording,
                    "--max-model-len", "4096", "--max-num-seqs", "512", *args.server_flags)
    try:
        args.base_url, args.model, args.ignore_eos, args.no_progress = server.url, "builtin:tiny-gpt-oss", True, True
        args.max_concurrency, args.num_prompts = args.concurrency, 4 * args.concurrency
        pids = stage_pids(server)
        before = {role: sum(cpu_seconds(p) for p in ps) for role, ps in pids.items()}
        spy = None
        if args.profile:  # profile the postproc and the engine while the load runs
            spy = [subprocess.Popen(["py-spy", "record", "-d", "8", "-r", "500", "-f", "raw",
                                     "-o", f"{args.profile}.{role}",
                                     "-p", str(pids[role][0])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for role in ("postproc", "engine", "ingress")]
        summary = serve(args)
        after = {role: sum(cpu_seconds(p) for p in ps) for role, ps in pids.items()}
        for p in spy or []:
            p.wait()
    finally:
        server.stop()
    tokens = summary["output_tokens"]
    print(f"{tokens} tokens, {summary['output_token_throughput']:.0f} tok/s at concurrency {args.concurrency}")
    for role in sorted(after, key=lambda r: before[r] - after[r]):
        used = after[role] - before[role]
        print(f"{role:9} {used:7.2f} CPU s   {1000 * used / tokens:7.3f} CPU s per 1,000 tokens")


if __name__ == "__main__":
    main()
