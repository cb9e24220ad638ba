"""A disaggregation hand-off handle is one lease: a generation engine that is sent one it took before (while
the lease still holds, or after its release) does not read it again. It recomputes the prompt (or fails the
request, with --kv-load-failure fail) and says so in its log; the first reader's lease is left alone."""
from __future__ import annotations

import logging

import msgspec

from sluice.engine.kv_handoff import IMPORTS
from sluice.ipc.messages import KvExport, KvImport, ids_to_bytes
from tests.engine.test_kv_handoff import handle_of, held, request, run, until_released

PROMPT = [(7 * i) % 500 + 3 for i in range(21)]


def handed_off(ctx, inbox, reply_to: str, rid: str) -> KvImport:
    """The context engine's answer for `rid`, as the KvImport a generation engine gets."""
    ctx.accept(request(rid, PROMPT, 1, 6, 5, KvExport(reply_to)))
    run(ctx, {}, {})
    (frame,) = inbox.get(timeout=5).frames
    params = msgspec.json.decode(frame.data)["choices"][0]["disaggregated_params"]
    return KvImport(handle_of(params), ids_to_bytes(params["first_gen_tokens"]))


def test_a_handle_sent_twice_while_its_lease_holds_is_read_once_and_recomputed_with_a_log_line(engines, caplog):
    ctx, gen, _, agg, inbox, reply_to = engines
    kv = handed_off(ctx, inbox, reply_to, "once")
    reads, recomputed = IMPORTS.labels("read")._value.get(), IMPORTS.labels("recomputed")._value.get()
    outputs, want = {}, {}
    with caplog.at_level(logging.WARNING, logger="sluice.engine"):
        gen.accept(request("first", PROMPT, 1, 6, 5, kv))
        gen.accept(request("again", PROMPT, 1, 6, 5, kv))  # the same handle, before the first released it
        run(gen, outputs, {})
    assert IMPORTS.labels("read")._value.get() == reads + 1
    assert IMPORTS.labels("recomputed")._value.get() == recomputed + 1
    assert any("again" in r.getMessage() and "used before, by request first" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    agg.accept(request("agg", PROMPT, 1, 6, 5))
    run(agg, want, {})
    assert outputs[("first", 0)] == outputs[("again", 0)] == want[("agg", 0)]
    until_released(ctx)  # the one release arrives
    assert held(ctx) == 0 and held(gen) == 0


def test_a_handle_sent_again_after_its_release_is_refused_under_kv_load_failure_fail(engines):
    ctx, _, strict, _, inbox, reply_to = engines
    kv = handed_off(ctx, inbox, reply_to, "twice")
    outputs, failed = {}, {}
    strict.accept(request("read", PROMPT, 1, 6, 5, kv))
    run(strict, outputs, failed)
    until_released(ctx)
    strict.accept(request("replayed", PROMPT, 1, 6, 5, kv))
    run(strict, outputs, failed)
    assert "read" not in failed and "used before, by request read" in failed["replayed"]
    assert held(ctx) == 0 and held(strict) == 0
