"""The mixture-of-experts layer's CPU cost against the experts it holds (engine/moe.py's SparseMoE, float32).

    python -m bench.moe [--hidden 1024] [--expert-size 384] [--top-k 8] [--experts 8,32,128] [--tokens 1,16,64]
                        [--hot 8] [--reps 20] [--float32-values] [--threads N]

For each number of experts held and each step's token count (decode batches), the layer's forward (router,
routing, the chosen experts, the weighted sum) timed four ways:

- routed: random router and inputs, each token choosing its top k among every expert held, on the CPU
  backend as the server runs it (engine/cpu/experts.py: the float32 kernels), and on torch's path (F.linear
  on each chosen expert's slice of the stacked weights);
- hot: the CPU backend again, but the router sends every token to the same `--hot` experts, so the experts
  chosen stay fixed while the experts held grow;
- dense: every expert held run on every row (one batched torch matmul), what the layer would cost if its cost
  grew with the experts held.

The weights' values are bf16 values (as a bf16 checkpoint's: the kernels then read them in bf16; torch's
paths read float32) unless --float32-values. The default shape is Qwen3-30B-A3B's halved (hidden 2048, experts
768 wide, top 8 of 128): each expert's weights are 4.5 MiB in float32, so beyond a few experts a step reads
them from memory. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import time

import torch

from sluice.engine.cpu.backend import CpuBackend
from sluice.engine.layers import Linear
from sluice.engine.moe import SparseMoE, route


def build(experts: int, hidden: int, size: int, top_k: int, bf16_values: bool) -> SparseMoE:
    gen = torch.Generator().manual_seed(0)
    moe = SparseMoE(hidden, experts, size, top_k, renormalize=True)
    with torch.no_grad():
        for p in moe.parameters():
            w = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(w.bfloat16().float() if bf16_values else w)
    return moe


def hot_router(moe: SparseMoE, hot: int, backend: CpuBackend) -> Linear:
    """The layer's router, but reading the inputs' first feature (`hot_inputs`) as a large vote for the experts
    below `hot` and against the rest; packed for the backend as the layer's own."""
    gate = Linear(moe.gate.in_features, moe.gate.out_features, bias=False)
    with torch.no_grad():
        gate.weight.copy_(moe.gate.weight.float())
        gate.weight[:, 0] = torch.where(torch.arange(gate.out_features) < hot, 8.0, -8.0)
    gate.run = backend.linear(gate)
    return gate


def hot_inputs(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[:, 0] = 4.0
    return x


def dense(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every row, weighted as the router weights them (zero for the experts not chosen)."""
    weights, chosen = route(moe.gate(x), moe.top_k, moe.renormalize)
    full = torch.zeros(x.shape[0], moe.gate.weight.shape[0]).scatter_(1, chosen, weights)  # [T, E]
    gate, up = torch.matmul(x, moe.experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
    y = torch.matmul(torch.nn.functional.silu(gate) * up, moe.experts.down_proj.transpose(1, 2))  # [E, T, D]
    return torch.einsum("te,etd->td", full, y)


def timed(fn, reps: int) -> float:
    """The fastest of `reps` calls, in ms, after two warm-up calls (the fastest: this bench's CPUs may be shared,
    and another process's time only ever adds to a call's)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-size", type=int, default=384)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", default="8,32,128")
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--hot", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--float32-values", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch's and the kernels' threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"hidden {args.hidden}, experts {args.expert_size} wide, top {args.top_k}, "
          f"{'float32' if args.float32_values else 'bf16'} weight values, {torch.get_num_threads()} threads; "
          f"ms per forward (the fastest of {args.reps}; dense of {max(3, args.reps // 5)})\n")
    print("| experts held | tokens | routed: experts chosen | routed ms, CPU backend | routed ms, torch | "
          "hot: experts chosen | hot ms, CPU backend | dense ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for experts in (int(e) for e in args.experts.split(",")):
        plain = build(experts, args.hidden, args.expert_size, args.top_k, not args.float32_values)
        served = build(experts, args.hidden, args.expert_size, args.top_k, not args.float32_values)
        CpuBackend(torch.float32).prepare(served, [])
        for tokens in (int(t) for t in args.tokens.split(",")):
            print(f"| {experts} | {tokens} | " + " | ".join(row(served, plain, tokens, args)) + " |", flush=True)


@torch.no_grad()
def row(served: SparseMoE, plain: SparseMoE, tokens: int, args: argparse.Namespace) -> list[str]:
    """The table's columns after experts held and tokens."""
    x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(tokens))
    chosen = route(served.gate(x), served.top_k, True)[1].unique().numel()
    routed = timed(lambda: served(x), args.reps)
    routed_torch = timed(lambda: plain(x), args.reps)
    dense_ms = timed(lambda: dense(plain, x), max(3, args.reps // 5))
    router, served.gate = served.gate, hot_router(served, args.hot, CpuBackend(torch.float32))
    hx = hot_inputs(x)
    hot_chosen = route(served.gate(hx), served.top_k, True)[1].unique().numel()
    hot = timed(lambda: served(hx), args.reps)
    served.gate = router
    return [str(chosen), f"{routed:.2f}", f"{routed_torch:.2f}", str(hot_chosen), f"{hot:.2f}", f"{dense_ms:.1f}"]

if __name__ == "__main__":
    main()
