"""The disaggregation engines the KV hand-off tests share (in process, no server)."""
import shutil
import uuid

import pytest
import zmq

from sluice.ipc.messages import IngressInput
from sluice.ipc.transport import PullChannel
from tests.engine.test_kv_handoff import make_engine


@pytest.fixture(scope="module")
def engines(tiny_chat_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("kv")
    tag = uuid.uuid4().hex[:8]  # the shared-memory directories are named after the runtime ones
    ctx = make_engine(tiny_chat_dir, base / f"sluice-ctx-{tag}", role="context")  # (its KV port: one it binds)
    gen = make_engine(tiny_chat_dir, base / f"sluice-gen-{tag}", role="generation")
    strict = make_engine(tiny_chat_dir, base / f"sluice-strict-{tag}", role="generation", kv_load_failure="fail")
    agg = make_engine(tiny_chat_dir, base / f"sluice-agg-{tag}")
    inbox: PullChannel[IngressInput] = PullChannel(zmq.Context.instance(), f"ipc://{base}/ingress", IngressInput)
    yield ctx, gen, strict, agg, inbox, f"ipc://{base}/ingress"
    for engine in (ctx, gen, strict, agg):
        shutil.rmtree(engine.cfg.addresses.shm_dir, ignore_errors=True)
