"""Context and generation engines wired together without processes: a context engine exports a prompt's KV
under a lease, a generation engine imports it and decodes on. Every block is accounted for, whatever
happens to the lease (read, aborted, expired, or a handle that cannot be read)."""
from __future__ import annotations

import base64
import itertools
import os
import shutil
import time
import uuid

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.base.config import ServerConfig
from sluice.engine.engine import Engine
from sluice.engine.kv_handoff import IMPORTS
from sluice.ipc.kv import ContextState
from sluice.ipc.messages import (Abort, EngineRequest, IngressInput, KvExport, KvImport, PostprocSpec, SamplingParams,
                                 ids_to_bytes)
from sluice.ipc.transport import PullChannel

_ids = itertools.count()
LEASE_S = 0.3


def make_engine(model_dir, tmp_path, **kw) -> Engine:
    kw = {"max_num_batched_tokens": 64, "num_kv_blocks": 96, "max_num_seqs": 16, **kw}
    cfg = ServerConfig(model="m", model_path=str(model_dir), served_model_names=["m"], runtime_dir=str(tmp_path),
                       max_model_len=256, block_size=4, disagg_secret="s", kv_lease_timeout=LEASE_S, **kw)
    os.makedirs(cfg.addresses.shm_dir, exist_ok=True)
    return Engine(cfg)


def request(rid: str, prompt: list[int], n: int, max_tokens: int, seed: int | None, kv=None,
            temperature: float = 0.9) -> EngineRequest:
    spec = PostprocSpec(request_id=rid, endpoint="completions", model="m", created=0, reply_to="", n=n)
    return EngineRequest(rid, ids_to_bytes(prompt), SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                   seed=seed), 0, msgspec.msgpack.encode(spec), n=n,
                         kv=kv)


def run(engine: Engine, outputs: dict, ended: dict, steps: int = 400) -> None:
    """Steps until the engine has nothing left (outputs: (request, choice) -> tokens)."""
    for _ in range(steps):
        result, _ = engine.step()
        for seq, token in result.new_tokens:
            outputs.setdefault((seq.request_id, seq.index), []).append(token)
        got = engine.take_ended()
        for seq, failed in got.failed:
            ended[seq.request_id] = failed.message
        if not len(engine.scheduler) and not engine.kv.imports.pending and not result.new_tokens:
            return
    raise AssertionError("the engine did not settle")


def handle_of(params: dict) -> bytes:
    """The transfer handle in a context answer's opaque state, as a KvImport carries it (the render unpacks it)."""
    return msgspec.msgpack.encode(ContextState.decode(base64.b64decode(params["encoded_opaque_state"])).handle)


def held(engine: Engine) -> int:
    return engine.scheduler.bm.num_used


def until_released(engine: Engine, timeout: float = 5.0) -> None:
    """Steps `engine` until the releases (and expiries) sent to it have freed its blocks, for at most `timeout`
    seconds: a release crosses a socket, and on a loaded machine it can land after the engine's next step."""
    run(engine, {}, {})
    deadline = time.monotonic() + timeout
    while held(engine) and time.monotonic() < deadline:
        time.sleep(0.02)
        run(engine, {}, {})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 3), st.integers(1, 6),
                                  st.sampled_from(["read", "abort", "expire", "forged", "forged-strict"]),
                                  st.booleans()), min_size=1, max_size=4))
def test_blocks_are_accounted_for_whatever_becomes_of_the_lease(engines, prompts):
    ctx, gen, strict, agg, inbox, reply_to = engines
    jobs = []
    for length, n, max_tokens, fate, seeded in prompts:
        k = next(_ids)
        rid = f"r{k}"
        prompt = [(7 * i + 31 * k) % 500 + 3 for i in range(length)]  # (not cached yet on the generation side)
        seed = 1234 if seeded else None
        jobs.append((rid, prompt, n, max_tokens, fate, seed))
        ctx.accept(request(rid, prompt, n, max_tokens, seed, KvExport(reply_to)))
    for rid, *_, fate, _ in jobs:
        if fate == "abort":
            ctx.accept(Abort([rid]))
    run(ctx, {}, {})
    answers = {}
    for frames in iter(lambda: inbox.get(timeout=0.5), None):
        for f in frames.frames:
            answers[f.request_id] = msgspec.json.decode(f.data)["choices"][0]["disaggregated_params"]
    assert set(answers) == {j[0] for j in jobs if j[4] != "abort"}
    assert held(ctx) > 0 or not answers  # each answered request's blocks, under its lease
    if any(j[4] == "expire" for j in jobs):
        time.sleep(LEASE_S + 0.05)
    outputs, want, failed = {}, {}, {}
    reads = IMPORTS.labels("read")._value.get()
    for rid, prompt, n, max_tokens, fate, seed in jobs:
        if fate == "abort":
            continue
        p = answers[rid]
        handle = b"not a handle" if fate.startswith("forged") else handle_of(p)
        target = strict if fate == "forged-strict" else gen
        target.accept(request(rid, prompt, n, max_tokens, seed,
                              KvImport(handle, ids_to_bytes(p["first_gen_tokens"]))))
        run(target, outputs, failed)
        if seed is not None and fate != "forged-strict":
            agg.accept(request(rid, prompt, n, max_tokens, seed))
            run(agg, want, {})
            for i in range(n):
                assert outputs[(rid, i)] == want[(rid, i)], (rid, fate)
        if fate == "forged-strict":
            assert "could not be loaded" in failed[rid]
    if any(j[4] == "read" and j[3] > 1 for j in jobs):  # a choice that goes on: its KV was read, not recomputed
        assert IMPORTS.labels("read")._value.get() > reads
    until_released(ctx, 2 * LEASE_S + 1)  # releases (and expiries) arrive
    for engine in (ctx, gen, strict, agg):
        assert held(engine) == 0 and not any(engine.scheduler.bm.ref_count)
    assert not ctx.kv._leases and not ctx.kv._exports and not gen.kv.imports.pending


def checkpoint(path, name: str):
    """A tiny checkpoint: test_architectures' variant `name`, written by transformers, or Mistral's layout with
    a window on every layer (one pool)."""
    if name == "mistral-window":
        from tokenizers import Tokenizer

        from sluice.app.builtin_models import ensure_builtin, write_llama_family

        tokenizer = Tokenizer.from_file(str(ensure_builtin("tiny-chat") / "tokenizer.json"))
        return write_llama_family(path, architecture="MistralForCausalLM", sliding_window=12, num_shards=1,
                                  tokenizer=tokenizer)
    from tests.engine.test_architectures import VARIANTS, write_checkpoint

    config_class, overrides, _ = VARIANTS[name]
    write_checkpoint(path, config_class, **overrides)
    return path


@pytest.mark.parametrize("model,kv", [("gemma3", "auto"), ("mistral-window", "auto"), ("deepseek-v2-lite", "auto"),
                                      ("mistral-window", "int8"), ("deepseek-v2-lite", "int8")])
def test_window_pools_and_latent_caches_are_read_whole_and_decode_as_one_server_does(model, kv, tmp_path):
    """Gemma 3 (sliding-window layers beside full-attention ones, as gpt-oss: their blocks in a pool of their
    own, window 12), Mistral's window on every layer (one pool) and DeepSeek-V2 (a latent cache, one tensor a
    layer): the context engine prefills in chunks (the window slides past the prompt's first blocks, which it
    frees), the generation engine reads every block the next token attends to, in each pool, and its greedy
    tokens (n=2) are those of the prompt served whole (by the context engine, under another cache salt:
    nothing of the hand-off reused); no prompt is recomputed. With --kv-cache-dtype int8 too: its rows' scales
    travel in the blocks' bytes."""
    path = checkpoint(tmp_path / "ckpt", model)
    tag = uuid.uuid4().hex[:8]
    small = dict(max_num_batched_tokens=16, num_kv_blocks=64, max_num_seqs=4, kv_cache_dtype=kv)
    ctx = make_engine(path, tmp_path / f"sluice-ctx-{tag}", role="context", **small)
    gen = make_engine(path, tmp_path / f"sluice-gen-{tag}", role="generation", kv_load_failure="fail", **small)
    assert kv == "auto" or {str(c.dtype) for e in (ctx, gen) for pair in e.runner.kv_caches for c in pair} \
        == {f"torch.{kv}"}
    reply_to = f"ipc://{tmp_path}/ingress"
    inbox: PullChannel[IngressInput] = PullChannel(zmq.Context.instance(), reply_to, IngressInput)
    try:
        prompt = [(37 * i) % 200 + 5 for i in range(31)]
        ctx.accept(request("r", prompt, 2, 10, None, KvExport(reply_to), temperature=0.0))
        run(ctx, {}, {})
        (frame,) = inbox.get(timeout=5).frames
        params = msgspec.json.decode(frame.data)["choices"][0]["disaggregated_params"]
        handle = ContextState.decode(base64.b64decode(params["encoded_opaque_state"])).handle
        if ctx.runner.sliding_window:  # the window's blocks travel, none before it (freed: -1)
            window = np.frombuffer((handle.window_blocks or handle.blocks)[0], dtype="<i4")
            freed = (16 - ctx.runner.sliding_window + 1) // 4  # (by the last chunk's step, from position 16)
            assert len(window) == 8 and freed and (window[:freed] == -1).all() and (window[freed:] >= 0).all()
        reads, recomputed = IMPORTS.labels("read")._value.get(), IMPORTS.labels("recomputed")._value.get()
        outputs, want, failed = {}, {}, {}
        gen.accept(request("r", prompt, 2, 10, None, KvImport(handle_of(params), ids_to_bytes(
            params["first_gen_tokens"])), temperature=0.0))
        run(gen, outputs, failed)
        whole = request("r", prompt, 2, 10, None, temperature=0.0)
        whole.cache_salt = "served whole"
        ctx.accept(whole)
        run(ctx, want, {})
        assert not failed and outputs == want and len(want[("r", 0)]) == 10
        assert IMPORTS.labels("read")._value.get() == reads + 1
        assert IMPORTS.labels("recomputed")._value.get() == recomputed
        until_released(ctx)
        for engine in (ctx, gen):
            pools = [engine.scheduler.bm] + ([engine.scheduler.window_pool] if engine.scheduler.window_pool else [])
            assert all(pool.num_used == 0 for pool in pools)
    finally:
        inbox.close()
        for engine in (ctx, gen):
            shutil.rmtree(engine.cfg.addresses.shm_dir, ignore_errors=True)
