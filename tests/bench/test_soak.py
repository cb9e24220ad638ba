"""bench/soak.py's classification of a request's ending: the bodies and streams each dialect sends (fast, no
server)."""
import json

from bench.soak import ANSWERED, CANCELLED, CUT, FAILED, LOST, REFUSED, classify, classify_stream, sse_events

JSON, SSE = "application/json", "text/event-stream"


def data(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def event(name: str, obj: object) -> str:
    return f"event: {name}\ndata: {json.dumps(obj)}\n\n"


OPENAI_ERROR = {"error": {"message": "the engine stopped", "type": "server_error", "code": None, "param": None}}
ANTHROPIC_ERROR = {"type": "error", "error": {"type": "api_error", "message": "the engine stopped"}}
CHUNK = {"object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
LAST = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}


def test_sse_events_names_data_and_comments():
    text = ": keepalive\n\nevent: ping\ndata: {}\n\ndata: a\ndata: b\n\ndata: [DONE]"
    assert sse_events(text) == [("ping", "{}"), ("", "a\nb"), ("", "[DONE]")]


def test_non_streaming_bodies():
    chat = {"object": "chat.completion", "choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]}
    assert classify("chat", False, 200, JSON, json.dumps(chat)) == (ANSWERED, "")
    unfinished = {"object": "chat.completion", "choices": [{"message": {"content": "x"}, "finish_reason": None}]}
    assert classify("chat", False, 200, JSON, json.dumps(unfinished))[0] == LOST
    assert classify("chat", False, 200, JSON, '{"object": "chat.comp')[0] == LOST  # cut mid-body
    completion = {"object": "text_completion", "choices": [{"text": "x", "finish_reason": "length"}]}
    assert classify("completions", False, 200, JSON, json.dumps(completion))[0] == ANSWERED
    response = {"object": "response", "status": "completed", "output": []}
    assert classify("responses", False, 200, JSON, json.dumps(response))[0] == ANSWERED
    assert classify("responses", False, 200, JSON, json.dumps({**response, "status": "in_progress"}))[0] == LOST
    assert classify("background", False, 200, JSON, json.dumps({**response, "status": "queued"}))[0] == ANSWERED
    message = {"type": "message", "content": [], "stop_reason": "max_tokens"}
    assert classify("messages", False, 200, JSON, json.dumps(message))[0] == ANSWERED
    assert classify("messages", False, 200, JSON, json.dumps({**message, "stop_reason": None}))[0] == LOST
    batch = {"type": "message_batch", "id": "msgbatch_1", "processing_status": "in_progress"}
    assert classify("batch", False, 200, JSON, json.dumps(batch))[0] == ANSWERED


def test_errors_count_as_clean_only_in_the_dialects_shape():
    assert classify("chat", False, 500, JSON, json.dumps(OPENAI_ERROR)) == (FAILED, "500")
    assert classify("messages", False, 503, JSON, json.dumps(ANTHROPIC_ERROR)) == (FAILED, "503")
    # the other dialect's shape, plain text, or a JSON body with a wrong content type: garbled
    assert classify("messages", False, 500, JSON, json.dumps(OPENAI_ERROR))[0] == LOST
    assert classify("chat", False, 500, "text/plain", "Internal Server Error")[0] == LOST
    assert classify("batch", False, 500, JSON, json.dumps({"error": "x"}))[0] == LOST
    assert classify("chat", False, 302, JSON, "{}")[0] == LOST


def test_openai_streams():
    done = "data: [DONE]\n\n"
    assert classify("chat", True, 200, SSE, data(CHUNK) + data(LAST) + done)[0] == ANSWERED
    assert classify("chat", True, 200, SSE, data(CHUNK) + data(LAST))[0] == LOST  # no [DONE]: cut
    assert classify("chat", True, 200, SSE, data(CHUNK) + done)[0] == LOST  # [DONE] but never finished
    assert classify("chat", True, 200, SSE, data(CHUNK) + data(OPENAI_ERROR) + done)[0] == FAILED
    assert classify("chat", True, 200, SSE, data(CHUNK) + "data: {\"obj\n\n" + done)[0] == LOST
    assert classify("chat", True, 200, JSON, data(CHUNK) + data(LAST) + done)[0] == LOST  # not an event stream
    assert classify("chat", True, 200, SSE, "")[0] == LOST


def test_responses_streams():
    created = data({"type": "response.created", "sequence_number": 0})
    assert classify_stream("responses", created + data({"type": "response.completed"}))[0] == ANSWERED
    assert classify_stream("responses", created + data({"type": "response.incomplete"}))[0] == ANSWERED
    failed = data({"type": "error", "message": "x"}) + data({"type": "response.failed"})
    assert classify_stream("responses", created + failed)[0] == FAILED
    assert classify_stream("responses", data({"type": "error", "message": "x"}))[0] == FAILED  # before created
    assert classify_stream("responses", created + data({"type": "response.output_text.delta"}))[0] == LOST


def test_anthropic_streams():
    start = event("message_start", {"type": "message_start"})
    stop = event("message_stop", {"type": "message_stop"})
    assert classify_stream("messages", start + stop)[0] == ANSWERED
    assert classify_stream("messages", start + event("error", ANTHROPIC_ERROR))[0] == FAILED
    assert classify_stream("messages", start + event("error", OPENAI_ERROR))[0] == LOST
    assert classify_stream("messages", start + event("content_block_delta", {}))[0] == LOST


def test_no_response_cancels_and_kills():
    # a connection refused while the script had the server down is the script's doing; any other time it is lost
    assert classify("chat", False, None, "", "", transport_error="connect", server_down=True)[0] == REFUSED
    assert classify("chat", False, None, "", "", transport_error="connect")[0] == LOST
    # a connection dropped while its ingress worker was killed: nothing was left to answer it
    assert classify("chat", True, None, "", "", transport_error="ReadError", ingress_killed=True)[0] == CUT
    assert classify("chat", True, 200, SSE, data(CHUNK), transport_error="RemoteProtocolError",
                    ingress_killed=True)[0] == CUT
    assert classify("chat", True, 200, SSE, data(CHUNK), transport_error="RemoteProtocolError")[0] == LOST
    # a hang is lost even during a kill
    assert classify("chat", False, None, "", "", transport_error="timeout", ingress_killed=True)[0] == LOST
    # the client left on purpose
    assert classify("chat", True, 200, SSE, data(CHUNK), cancelled=True)[0] == CANCELLED
    # a refusal before the stream began is still judged
    assert classify("chat", True, 503, JSON, json.dumps(OPENAI_ERROR), cancelled=True)[0] == FAILED


def test_memory_compares_each_process_with_its_own_baseline():
    from bench.soak import compare_memory

    def mem(anon_mb: float, rss_mb: float) -> dict[str, int]:
        return {"anon": int(anon_mb * 1024), "rss": int(rss_mb * 1024)}

    baseline = {1: ("ingress", mem(30, 60)), 2: ("ingress", mem(30, 60)), 3: ("render 0", mem(40, 70)),
                4: ("render 1", mem(40, 70))}  # render 1 (pid 4) is killed: pid 5 replaces it with its own baseline
    baseline[5] = ("render 1", mem(50, 70))
    end = {1: ("ingress", mem(31, 45)), 2: ("ingress", mem(32, 45)), 3: ("render 0", mem(40, 50)),
           5: ("render 1", mem(52, 50)), 6: ("postproc 0", mem(30, 40))}  # pid 6: no baseline, left out
    rows, totals, ok = compare_memory(baseline, end)
    assert [r["pid"] for r in rows] == [1, 2, 3, 5]
    assert totals["ingress"]["start_mb"] == 60 and totals["ingress"]["end_mb"] == 63
    assert totals["render"]["ratio"] == round(92 / 90, 3) and "postproc" not in totals
    assert ok  # VmRSS fell (pages dropped): not judged; RssAnon within 10% everywhere
    end[2] = ("ingress", mem(34, 61))  # one ingress worker 13% up: it fails alone, though its role's total is +8%
    rows, totals, ok = compare_memory(baseline, end)
    assert totals["ingress"]["ratio"] <= 1.10 and not ok
