"""Where a decode step's time goes, in process, and what each vocabulary-sized kernel choice costs.

    python -m bench.step_parts [--model tiny-llama-o200k] [--batches 1,16,64] [--dtype bfloat16] [--prompt-len 130]
                               [--prefill-steps] [--mixed] [--kernels] [--layers] [--no-keep-heap]
    python -m bench.step_parts --linears [576x576,1536x576,...] [--batches 1,16,64]
    python -m bench.step_parts --causal [9/3x64,16/8x128,...] --batches 500,2000

Part 1 runs Sluice's scheduler and paged runner on a checkpoint (bench/checkpoints.py's names, or a path;
the tiny o200k Llama by default) with 130-token prompts by default,
so each decode attends to ~130-190 keys, as in bench/peer.py's load) and times each part of a decode step,
greedy and at temperature 1. --prefill-steps times, beside batch - 1 decodes, the steps that also carry
a new request's whole prompt (at concurrency 16 with 64-token answers, one step in four); --mixed times
decode steps whose rows are half greedy, half at temperature 1, beside all of either. Part 2
(--kernels) times the choices the runner and sampler make against the plain torch calls they replace, on
the same shapes. --linears alone (no model) times the float32 linear of each weight shape [N, K]: F.linear on
the float32 weight against Sluice's float32 kernel (the best this CPU runs: AVX-512F or AVX2) on the weight
in bf16 and in float32, beside the floor a copy of the weight's bytes sets (torch's copy_, the same
repeated, cache-warm way). --causal alone times whole prompts' attention (float32, one sequence of each
--batches length): torch's causal SDPA against csrc/causal_attention.c.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.checkpoints import CHECKPOINTS, checkpoint
from sluice.engine.attention import _attention
from sluice.engine.block_manager import BlockManager
from sluice.engine.cpu import ops
from sluice.engine.cpu.backend import CpuBackend
from sluice.engine.cpu.lm_head import onednn_packed
from sluice.engine.cpu.matmul import F32Matmul
from sluice.engine.lm_head import lm_head
from sluice.engine.loader import load_model
from sluice.engine.logit_constraints import plain_greedy
from sluice.engine.model_runner import ModelRunner
from sluice.engine.sampler import SamplingBatch, argmax, exp_blocks, inverse_cdf, sample
from sluice.engine.scheduler import Scheduler
from sluice.engine.sequence import Sequence
from sluice.engine.worker import keep_heap_memory
from sluice.ipc.messages import SamplingParams

PARTS = ("schedule", "prepare", "backbone", "lm head", "sampling", "update")


def _engine(model, dtype) -> tuple[ModelRunner, Scheduler, np.random.Generator]:
    """A runner and scheduler as the benchmarks here drive them, and a seeded generator for prompts."""
    runner = ModelRunner(model, 4096, 16, dtype, torch.device("cpu"))
    sched = Scheduler(BlockManager(4096, 16), max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    return runner, sched, np.random.default_rng(0)


def _prompt(rng: np.random.Generator, model, length: int) -> list[int]:
    """Random token ids of the model's vocabulary (at most the first 199,000: o200k's ordinary tokens)."""
    return rng.integers(0, min(199_000, model.config.vocab_size), length).tolist()


def step_parts(model, dtype, batch: int, temperature: float, steps: int = 40,
               prompt_len: int = 130) -> dict[str, float]:
    """Mean milliseconds of each part of a decode step at this batch size."""
    runner, sched, rng = _engine(model, dtype)
    for i in range(batch):
        sched.add(Sequence(f"r{i}", _prompt(rng, model, prompt_len),
                           SamplingParams(max_tokens=steps + 20, temperature=temperature), seed=i))
    for _ in range(10):  # the prefill, then warm-up decodes
        b = sched.schedule()
        assert b is not None  # (every sequence is still running)
        sched.update(b, runner.run(b).tokens)
    total = dict.fromkeys(PARTS, 0.0)

    def timed(part, fn):
        t0 = time.perf_counter()
        out = fn()
        total[part] += time.perf_counter() - t0
        return out

    with torch.inference_mode():
        for _ in range(steps):
            b = timed("schedule", sched.schedule)
            assert b is not None
            inputs = timed("prepare", lambda: runner._prepare(b))
            hidden = timed("backbone", lambda: runner.model(inputs.input_ids, inputs.positions,
                                                             runner.kv_caches, inputs.meta, inputs.logits_index))
            seqs, exp = inputs.sampling_seqs, runner.exp_kernels
            if all(map(plain_greedy, seqs)):  # as the runner does: the argmax without the logits
                ids = timed("lm head", lambda: runner.lm_head.argmax(hidden))
                tokens = timed("sampling", ids.tolist)
            else:
                logits = timed("lm head", lambda: runner.lm_head(hidden))
                tokens = timed("sampling",
                               lambda: sample(logits, SamplingBatch.for_seqs(seqs, runner.device, exp)).tolist())
            timed("update", lambda: sched.update(b, tokens))
    return {k: 1000 * v / steps for k, v in total.items()}


def prefill_steps(model, dtype, batch: int, prompt_len: int = 130, steps: int = 60) -> tuple[float, float]:
    """(mean ms of a greedy step of `batch` - 1 decodes alone, of one that also carries a new request's
    whole prompt): as a server at this concurrency runs when requests end and others take their place."""
    runner, sched, rng = _engine(model, dtype)

    def prompt():
        return _prompt(rng, model, prompt_len)

    for i in range(batch - 1):
        sched.add(Sequence(f"r{i}", prompt(), SamplingParams(max_tokens=10_000, temperature=0.0), seed=i))
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(20 + steps):
        if i >= 20 and i % 3 == 0:  # a one-token request: its prompt, then it is gone
            sched.add(Sequence(f"n{i}", prompt(), SamplingParams(max_tokens=1, temperature=0.0), seed=i))
        b = sched.schedule()
        assert b is not None  # (the batch - 1 long requests run throughout)
        t0 = time.perf_counter()
        sched.update(b, runner.run(b).tokens)
        if i >= 20:
            times[max(b.num_new_tokens) > 1].append(time.perf_counter() - t0)
    return 1000 * float(np.mean(times[False])), 1000 * float(np.mean(times[True]))


def mixed_steps(model, dtype, batch: int, prompt_len: int = 130, steps: int = 40) -> dict[str, float]:
    """Mean ms of a decode step whose rows are all at temperature 1, half greedy (every other row) and
    all greedy: a server whose clients differ."""
    out = {}
    for name, greedy in (("sampled", lambda i: False), ("half greedy", lambda i: i % 2 == 0),
                         ("greedy", lambda i: True)):
        runner, sched, rng = _engine(model, dtype)
        for i in range(batch):
            sched.add(Sequence(f"r{i}", _prompt(rng, model, prompt_len),
                               SamplingParams(max_tokens=10_000, temperature=0.0 if greedy(i) else 1.0), seed=i))
        times = []
        for i in range(10 + steps):  # the prefill and warm-up decodes first
            b = sched.schedule()
            assert b is not None  # (max_tokens 10,000: every sequence runs throughout)
            t0 = time.perf_counter()
            sched.update(b, runner.run(b).tokens)
            times.append(time.perf_counter() - t0)
        out[name] = 1000 * float(np.mean(times[10:]))
    return out


def bench_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1000 * (time.perf_counter() - t0) / n


def kernels(model, batches: list[int]) -> list[tuple[str, int, float, float]]:
    """(what, batch, plain torch ms, Sluice's ms) for each kernel choice."""
    weight = model.lm_weight().detach().bfloat16()
    head, packed = lm_head(weight), onednn_packed(weight)
    onednn = lambda h: torch.ops.mkldnn._linear_pointwise(h, packed, None, "none", [], "")  # noqa: E731
    rows = []
    for b in batches:
        h = torch.randn(b, weight.shape[1]).bfloat16()
        rows.append(("LM head, bf16 (F.linear / Sluice's)", b, bench_ms(lambda: F.linear(h, weight)),
                     bench_ms(lambda: head(h))))
        rows.append(("LM head, bf16 (oneDNN packed / Sluice's)", b, bench_ms(lambda: onednn(h)),
                     bench_ms(lambda: head(h))))
        rows.append(("greedy LM head (oneDNN + blocked argmax / fused)", b, bench_ms(lambda: argmax(onednn(h))),
                     bench_ms(lambda: head.argmax(h))))
        logits = torch.randn(b, weight.shape[0]) * 3
        rows.append(("greedy (torch.argmax / blocked)", b, bench_ms(lambda: logits.argmax(-1)),
                     bench_ms(lambda: argmax(logits))))
        u = torch.rand(b)

        def full_cdf():  # the previous sampler: exp one op at a time, then a full-vocabulary cumsum
            p = logits.clone()
            p = p.sub_(p.amax(-1, keepdim=True)).exp_().cumsum_(-1)
            return torch.searchsorted(p, (u * p[:, -1]).unsqueeze(1), right=True)

        ones = torch.ones(b, 1)

        def exp_pass():  # the sampler's: one pass for the probabilities and their block sums
            probs, sums = exp_blocks(logits, ones, CpuBackend(torch.float32).exp_kernels())
            return inverse_cdf(probs, u, sums)

        rows.append(("temperature 1 (exp + cumsum / exp pass + two-level)", b, bench_ms(full_cdf),
                     bench_ms(exp_pass)))
        # decode attention as a step runs it: each sequence's 160 keys scattered over a paged cache
        caches = [torch.randn(4096 * 16, 2, 32).bfloat16() for _ in range(2)]
        slots = torch.randperm(4096 * 16)[: b * 160].view(b, 160)
        mask = torch.ones(b, 1, 1, 160, dtype=torch.bool)
        q = torch.randn(b, 4, 32).bfloat16()
        out = torch.empty(b + 1, 4, 32).bfloat16()

        def torch_path():  # what the runner did: gather, float32 matmuls (SDPA at batch 1)
            qg = q.unsqueeze(1).transpose(1, 2)
            kg, vg = (c.index_select(0, slots.view(-1)).view(b, 160, 2, 32).transpose(1, 2) for c in caches)
            if b == 1:
                return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=0.17, enable_gqa=True)
            return _attention(qg, kg, vg, mask, 0.17)

        k_cache, v_cache = caches
        rows.append(("decode attention, 160 keys (gather + matmuls / kernel)", b, bench_ms(torch_path, 200),
                     bench_ms(lambda: ops.decode_attention(q, k_cache, v_cache, torch.arange(b), slots, mask, 0.17,
                                                           None, out), 200)))
    return rows


LINEAR_SHAPES = "576x576,1536x576,576x1536,49152x576,1024x3072"


def timed_ms(fn, seconds: float = 0.25) -> float:
    """ms of fn: the best of 4 means of runs over about `seconds` in all (the least disturbed by other work
    on the machine)."""
    fn()
    t0 = time.perf_counter()
    fn()
    n = max(2, min(500, int(seconds / 4 / max(time.perf_counter() - t0, 1e-6))))
    return min(bench_ms(fn, n) for _ in range(4))


def linears(shapes: list[tuple[int, int]], batches: list[int]) -> list[tuple]:
    """(N, K, batch, the kernel's instructions, ms of: F.linear on float32, the kernel on bf16, the kernel on
    float32, a copy of the bf16 weight's bytes, a copy of the float32 weight's bytes) for each shape."""
    rows = []
    for n, k in shapes:
        weight = torch.randn(n, k).bfloat16().float()  # (bf16 values: a bf16 checkpoint served in float32)
        bf16, fp32 = F32Matmul.build(weight.bfloat16()), F32Matmul.build(weight)
        if bf16 is None or fp32 is None:
            raise SystemExit("Sluice's float32 kernel does not run on this CPU")
        copies = []
        for nbytes in (bf16.nbytes, fp32.nbytes):
            src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            copies.append(timed_ms(lambda: dst.copy_(src)))
        for b in batches:
            x = torch.randn(b, k)
            rows.append((n, k, b, bf16.isa, timed_ms(lambda: F.linear(x, weight)), timed_ms(lambda: bf16(x)),
                         timed_ms(lambda: fp32(x)), *copies))
    return rows


CAUSAL_SHAPES = "9/3x64,16/8x128,32/8x64"  # heads / kv heads x head dim: the 135M, Qwen3-0.6B, Llama-3.2-1B shapes


def print_causal(shapes: str, lengths: list[int]) -> None:
    """Whole prompts' attention, one sequence, float32: torch's causal SDPA against csrc/causal_attention.c."""
    print(f"{'heads':>9} {'dim':>4} {'tokens':>6} {'SDPA ms':>8} {'kernel ms':>9} {'SDPA GFLOP/s':>12} "
          f"{'kernel GFLOP/s':>14}")
    for shape in shapes.split(","):
        heads, rest = shape.split("/")
        kv_heads, dim = (int(x) for x in rest.split("x"))
        for n in lengths:
            q = torch.randn(1, n, int(heads), dim)
            k, v = torch.randn(1, n, kv_heads, dim), torch.randn(1, n, kv_heads, dim)
            sdpa = timed_ms(lambda: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True), 1.0)
            if ops.causal_attention(q, k, v, 1.0) is None:
                raise SystemExit("csrc/causal_attention.c does not run on this CPU (it needs AVX-512F, or AVX2 "
                                 "and FMA)")
            kernel = timed_ms(lambda: ops.causal_attention(q, k, v, dim ** -0.5), 1.0)
            flops = 2 * n * (n + 1) * int(heads) * dim  # q.k and p.v over the keys each query attends
            print(f"{heads + '/' + str(kv_heads):>9} {dim:>4} {n:>6} {sdpa:>8.2f} {kernel:>9.2f} "
                  f"{flops / sdpa / 1e6:>12.0f} {flops / kernel / 1e6:>14.0f}")


def print_linears(shapes: str, batches: list[int]) -> None:
    print(f"{'N x K':>11} {'batch':>5} {'kernel':>8} {'F.linear fp32':>13} {'bf16 weight':>11} {'fp32 weight':>11}"
          f" {'copy bf16 B':>11} {'copy fp32 B':>11}  (ms; the bf16 weight's GB/s)")
    parsed = [(int(n), int(k)) for n, k in (s.split("x") for s in shapes.split(","))]
    for n, k, b, isa, *ms in linears(parsed, batches):
        print(f"{n:>5} x {k:<5} {b:>5} {isa:>8} {ms[0]:>13.4f} "
              + " ".join(f"{t:>11.4f}" for t in ms[1:]) + f"  ({2 * n * k / ms[1] / 1e6:.1f})")


def layer_parts(model, dtype, batch: int, prompt_len: int = 130, n: int = 20) -> list[tuple[str, float, float]]:
    """(op, torch's ms, Sluice's ms) for each op of one decoder layer (the model's first) at a decode step of
    `batch` rows: torch's path op by op (F.linear, torch's norm, rotary and attention) against the backend's
    kernels op by op; then a layer in a step, op by op (the backend's kernels) against the layers in one call
    (a step's backbone over its number of layers). Each op's inputs come from a real decode step; the ops
    alone run warm (one layer's weights stay cached: its linears run faster than in a step, whose weights
    come from memory)."""
    from sluice.engine.attention import paged_attention, rope_and_store
    from sluice.engine.backend import TORCH
    from sluice.engine.quant import dequantized

    runner, sched, rng = _engine(model, dtype)
    for i in range(batch):
        sched.add(Sequence(f"r{i}", _prompt(rng, model, prompt_len), SamplingParams(max_tokens=1000), seed=i))
    for _ in range(10):
        b = sched.schedule()
        assert b is not None  # (max_tokens 1,000: every sequence runs throughout)
        sched.update(b, runner.run(b).tokens)
    b = sched.schedule()
    assert b is not None
    inputs = runner._prepare(b)
    meta, positions = inputs.meta, inputs.positions
    layer, kv = model.model.layers[0], runner.kv_caches[0]
    attn, mlp, backend = layer.self_attn, layer.mlp, runner.backend
    h, hkv, d = attn.heads
    # (a linear held packed by its kernel has an empty weight: the kernel's rows are its values; a quantized
    # one's, its parts dequantized)
    weights = {m: (m.weight if m.weight.numel() else m.run.rows(torch.arange(m.run.n)) if hasattr(m.run, "rows")
                   else dequantized(m.run.parts)).to(dtype)
               for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)}
    x = torch.randn(batch, model.config.hidden_size, dtype=dtype)
    qkv = attn.qkv_proj(x).view(batch, h + 2 * hkv, d)
    q = rope_and_store(qkv[:, : h + hkv], qkv[:, h + hkv :], h, attn.rotary, positions, *kv, meta.slot_mapping[None])
    o = torch.randn(batch, h * d, dtype=dtype)
    gu = mlp.gate_up_proj(x)
    act = torch.randn(batch, gu.shape[1] // 2, dtype=dtype)

    def timed(fn) -> float:
        return bench_ms(fn, n)

    def torch_linear(m, inp):
        return lambda: F.linear(inp, weights[m], m.bias)

    def silu_mul():
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    rows = [
        ("RMSNorm", timed(lambda: TORCH.rms_norm(x, layer.input_layernorm.weight, 1e-6)),
         timed(lambda: backend.rms_norm(x, layer.input_layernorm.weight, 1e-6))),
        ("qkv projection", timed(torch_linear(attn.qkv_proj, x)), timed(lambda: attn.qkv_proj(x))),
        ("rotary + KV store", timed(lambda: rope_and_store(qkv[:, : h + hkv], qkv[:, h + hkv :], h, attn.rotary,
                                                            positions, *kv, meta.slot_mapping[None])),
         timed(lambda: backend.rope_and_store(qkv[:, : h + hkv], qkv[:, h + hkv :], h, attn.rotary, positions, *kv,
                                              meta.slot_mapping[None]))),
        ("paged attention", timed(lambda: paged_attention(q, *kv, meta, attn.scale, None, attn.sinks)),
         timed(lambda: backend.paged_attention(q, *kv, meta, attn.scale, None, attn.sinks))),
        ("o projection", timed(torch_linear(attn.o_proj, o)), timed(lambda: attn.o_proj(o))),
        ("residual add", timed(lambda: x + x), timed(lambda: x + x)),
        ("gate/up projection", timed(torch_linear(mlp.gate_up_proj, x)), timed(lambda: mlp.gate_up_proj(x))),
        ("SwiGLU", timed(silu_mul), timed(silu_mul)),
        ("down projection", timed(torch_linear(mlp.down_proj, act)), timed(lambda: mlp.down_proj(act))),
    ]
    rows.append(("sum of the ops", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    backbone = model.model
    stack, backbone.stack = backbone.stack, None
    with torch.inference_mode():
        def step():
            backbone(inputs.input_ids, positions, runner.kv_caches, meta, inputs.logits_index)
        op_by_op = bench_ms(step, 5)
        backbone.stack = stack
        one_call = bench_ms(step, 5)
    layers = len(backbone.layers)
    rows.append(("a layer in a step: op by op (kernels) / one call", op_by_op / layers, one_call / layers))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama-o200k", help=f"a path, or one of {', '.join(CHECKPOINTS)}")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--layers", action="store_true", help="also time each op of one decoder layer")
    parser.add_argument("--prefill-steps", action="store_true",
                        help="also time steps that carry a new request's prompt beside batch - 1 decodes")
    parser.add_argument("--mixed", action="store_true",
                        help="also time decode steps whose rows are half greedy, half at temperature 1")
    parser.add_argument("--prompt-len", type=int, default=130, help="tokens of each sequence's prompt")
    parser.add_argument("--no-keep-heap", action="store_true",
                        help="leave glibc's malloc as it is (the engine process keeps large tensors on the heap)")
    parser.add_argument("--linears", nargs="?", const=LINEAR_SHAPES, metavar="NxK,...",
                        help=f"only time float32 linears of these weight shapes (default {LINEAR_SHAPES})")
    parser.add_argument("--causal", nargs="?", const=CAUSAL_SHAPES, metavar="H/HKVxD,...",
                        help=f"only time whole prompts' attention of these head shapes, --batches as prompt lengths "
                             f"(default {CAUSAL_SHAPES})")
    args = parser.parse_args()
    if not args.no_keep_heap:
        keep_heap_memory()
    if args.causal:
        print_causal(args.causal, [int(b) for b in args.batches.split(",")])
        return
    if args.linears:
        print_linears(args.linears, [int(b) for b in args.batches.split(",")])
        return
    dtype = getattr(torch, args.dtype)
    path = Path(args.model) if Path(args.model).is_dir() else checkpoint(args.model)
    model = load_model(path, dtype, torch.device("cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{'batch':>5} {'temp':>4} " + " ".join(f"{p:>9}" for p in PARTS) + f" {'step ms':>8}")
    for b in batches:
        for temp in (0.0, 1.0):
            parts = step_parts(model, dtype, b, temp, prompt_len=args.prompt_len)
            print(f"{b:>5} {temp:>4g} " + " ".join(f"{parts[p]:>9.2f}" for p in PARTS)
                  + f" {sum(parts.values()):>8.2f}")
    if args.prefill_steps:
        print(f"\n{'batch':>5} {'decodes alone ms':>17} {'+ a prefill ms':>15}  "
              f"(greedy, {args.prompt_len}-token prompts)")
        for b in (b for b in batches if b > 1):
            alone, mixed = prefill_steps(model, dtype, b, args.prompt_len)
            print(f"{b:>5} {alone:>17.2f} {mixed:>15.2f}")
    if args.mixed:
        print(f"\n{'batch':>5} {'temperature 1 ms':>17} {'half greedy ms':>15} {'greedy ms':>10}")
        for b in (b for b in batches if b > 1):
            ms = mixed_steps(model, dtype, b, args.prompt_len)
            print(f"{b:>5} {ms['sampled']:>17.2f} {ms['half greedy']:>15.2f} {ms['greedy']:>10.2f}")
    if args.layers:
        for b in batches:
            print(f"\n{'one layer, batch ' + str(b) + ' (ms)':52} {'torch':>9} {'sluice':>9} {'speed-up':>8}")
            for what, plain, ours in layer_parts(model, dtype, b, args.prompt_len):
                print(f"{what:52} {plain:>9.3f} {ours:>9.3f} {plain / max(ours, 1e-9):>8.1f}")
    if args.kernels:
        print(f"\n{'kernel (torch / Sluice)':52} {'batch':>5} {'torch ms':>9} {'sluice ms':>9} {'speed-up':>8}")
        for what, b, plain, ours in kernels(model, batches):
            print(f"{what:52} {b:>5} {plain:>9.2f} {ours:>9.2f} {plain / ours:>8.1f}")


if __name__ == "__main__":
    main()
