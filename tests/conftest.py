import os
import sys
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Built-in checkpoints for the whole session go to one temporary cache.
os.environ.setdefault("SLUICE_CACHE_DIR",
                      str(Path(os.environ.get("TMPDIR", "/tmp")) / f"sluice-test-cache-{os.getuid()}"))


_SHARED_SERVERS = {"server", "client", "aclient", "trio"}
_HARNESS = ("Server", "RouterProc", "Trio")  # bench.server's, bench.router's, tests.disagg.helpers'
# In-process modules that load models and compare them with transformers, build and compare kernels, or run
# mypy: `slow`, so that `-m "unit and not slow"` is the edit-test loop.
_SLOW = {"test_architectures", "test_moe", "test_gguf", "test_gpt_oss", "test_model_vs_transformers",
         "test_f32_kernels", "test_cpu_kernels", "test_decoder_stack", "test_quant", "test_kernel_builds",
         "test_engine_postproc", "test_kv_handoff", "test_structured_output", "test_prefix_cache", "test_layers",
         "test_harness", "test_lint", "test_harmony", "test_structured", "test_unsatisfiable_constraints",
         "test_health_generate", "test_thinking_budget", "test_prediction_model", "test_gptq", "test_w8a8",
         "test_tool_formats_held", "test_avx2_step", "test_quant_repack"}


def pytest_collection_modifyitems(config, items):
    """The tiers: `e2e` starts real server processes (tests/e2e, tests/disagg, a module that uses the harness,
    a test that uses the shared servers); `unit` runs in process, and `slow` marks the unit modules above.
    `pytest -m "unit and not slow"` is the edit-test loop."""
    for item in items:
        module = vars(getattr(item, "module", None) or object)
        real = ({"e2e", "disagg"} & set(item.path.parts) or any(name in module for name in _HARNESS)
                or _SHARED_SERVERS & set(getattr(item, "fixturenames", ())))
        item.add_marker(pytest.mark.e2e if real else pytest.mark.unit)
        if not real and item.path.stem in _SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_chat_dir() -> Path:
    from sluice.app.builtin_models import ensure_builtin

    return ensure_builtin("tiny-chat")


@pytest.fixture(scope="session")
def server():
    from bench.server import Server

    s = Server("--postproc-workers", "2", "--render-workers", "2", "--ingress-workers", "2")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def aclient(server):
    """A factory: an async client belongs to the event loop it is used in."""
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def trio(tiny_chat_dir, tmp_path_factory):
    """A context worker, a generation worker and an aggregated server of the real tiny model (shared by the
    disaggregation and router tests: each leaves them as it found them). `gen_timing`, `ctx_timing`: the
    workers' --kv-timing-output. The context worker takes unsigned context_only requests, as TensorRT-LLM's
    orchestrator sends them."""
    from tests.disagg.helpers import Trio

    timing = tmp_path_factory.mktemp("kv-timing") / "gen.jsonl"
    ctx_timing = timing.with_name("ctx.jsonl")
    t = Trio(("--kv-lease-timeout", "3", "--disagg-unsigned-context", "--kv-timing-output", str(ctx_timing)),
             ("--kv-timing-output", str(timing)))
    t.gen_timing, t.ctx_timing = timing, ctx_timing
    yield t
    t.stop()
