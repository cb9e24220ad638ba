"""A mixed soak under fire: one `sluice serve` (builtin:tiny-chat, a --state-dir, 2 render, 2 postproc and 2
ingress workers) under a bounded mixed load from a few client threads (OpenAI chat and completions, Responses
with store / previous_response_id / background, Anthropic messages and message batches, stored chat
completions; streaming and not; some clients leave mid-stream), with scheduled events: kill -9 once each of a
render worker, a postproc worker, an ingress worker and the engine (the supervisor fails what is in flight and
exits non-zero: this script restarts it on the same --state-dir, as systemd would), and one whole-server
restart (SIGTERM, then start again on the same --state-dir).

Every request is classified (`classify`): answered (a 200 with a complete body, a stream that ended with its
terminal event), failed (a 4xx/5xx in the dialect's shape, a stream that ended with the dialect's error
event), cancelled (the client left mid-stream on purpose), refused (connection refused while this script had
the server down), cut (the connection dropped while its ingress worker was being killed: nothing is left to
answer it) or lost (anything else: a dropped connection, a hang past the client timeout, a garbled body;
must be 0). At the end every stored object (response, background response, batch, stored chat completion)
created by an answered request is fetched again: each must be there.

Memory: each ingress, render and postproc process is sampled after a warm-up (load paused, a few quiet
seconds) and again at the end of its server's life after a quiet period; a worker restarted by a kill gets its
own baseline once it has warmed up under the load, and a server restarted (after the engine kill, after the
SIGTERM) starts a new epoch with new baselines. The figure judged is RssAnon (the private heap, where a leak
shows): on a machine short of memory the kernel drops the file-backed pages of a process's shared libraries
and VmRSS falls by tens of MB whatever the process does (VmRSS is reported beside it). Each process, and each
role's total, must end within 10% of its baseline.

    python -m bench.soak [--minutes 30] [--quick] [--clients 4] [--out FILE]

Loopback only; the load is bounded (a few clients, small max_tokens, a pause between requests).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.faults import ingress_workers, stage_pids, wait_restarted
from bench.procs import descendants, title
from bench.server import Server

MODEL = "builtin:tiny-chat"
ROLES = ("ingress", "render", "postproc")
ANSWERED, FAILED, CANCELLED, REFUSED, CUT, LOST = "answered", "failed", "cancelled", "refused", "cut", "lost"
ANTHROPIC_KINDS = {"messages", "batch", "batch_get", "batch_results"}

# ---- classification (pure: tests/bench/test_soak.py) ---------------------------------------------------------


def error_shaped(kind: str, body: object) -> bool:
    """Whether a JSON body is an error in the dialect's shape: OpenAI's {"error": {"message", ...}} or
    Anthropic's {"type": "error", "error": {"type", "message"}}."""
    if not isinstance(body, dict):
        return False
    err = body.get("error")
    if kind in ANTHROPIC_KINDS:
        return body.get("type") == "error" and isinstance(err, dict) and isinstance(err.get("type"), str) \
            and isinstance(err.get("message"), str)
    return isinstance(err, dict) and isinstance(err.get("message"), str)


def complete(kind: str, body: object) -> bool:
    """Whether a 200 JSON body is a whole answer of its kind."""
    if not isinstance(body, dict):
        return False
    if kind in ("chat", "stored_chat"):
        choices: Any = body.get("choices")
        return body.get("object") == "chat.completion" and bool(choices) and \
            choices[0].get("finish_reason") is not None and "message" in choices[0]
    if kind == "completions":
        choices = body.get("choices")
        return body.get("object") == "text_completion" and bool(choices) and \
            choices[0].get("finish_reason") is not None and isinstance(choices[0].get("text"), str)
    if kind == "responses":
        return body.get("object") == "response" and body.get("status") in ("completed", "incomplete") and \
            isinstance(body.get("output"), list)
    if kind == "background":  # (POST ... background: true answers at once, queued)
        return body.get("object") == "response" and body.get("status") in (
            "queued", "in_progress", "completed", "incomplete", "failed", "cancelled")
    if kind == "messages":
        return body.get("type") == "message" and body.get("stop_reason") is not None and \
            isinstance(body.get("content"), list)
    if kind in ("batch", "batch_get"):
        return body.get("type") == "message_batch" and isinstance(body.get("id"), str)
    return isinstance(body.get("id"), str)  # a retrieve: the object itself


def sse_events(text: str) -> list[tuple[str, str]]:
    """(event name, data) of each event of an SSE body (the name "" where none was given); comments skipped."""
    events: list[tuple[str, str]] = []
    name, data = "", list[str]()
    for line in text.split("\n"):
        line = line.rstrip("\r")
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = "", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        events.append((name, "\n".join(data)))
    return events


def _json(data: str) -> object:
    try:
        return json.loads(data)
    except ValueError:
        return None


def classify_stream(kind: str, text: str) -> tuple[str, str]:
    """A 200 stream read to its end: answered if it ended with its dialect's terminal event, failed if with the
    dialect's error event, else lost (why in the second item)."""
    events = sse_events(text)
    if not events:
        return LOST, "an empty stream"
    if kind in ("chat", "completions", "stored_chat"):
        if events[-1][1] != "[DONE]":
            return LOST, "no [DONE] at the end"
        chunks = [_json(d) for _, d in events[:-1]]
        if any(c is None for c in chunks):
            return LOST, "a chunk that is not JSON"
        if any(isinstance(c, dict) and "error" in c for c in chunks):
            last = chunks[-1]
            return (FAILED, "error event") if error_shaped(kind, last) else (LOST, "an error chunk not at the end")
        finished = any(ch.get("finish_reason") for c in chunks if isinstance(c, dict) for ch in c.get("choices") or [])
        return (ANSWERED, "") if finished else (LOST, "[DONE] without a finish_reason")
    if kind == "responses":
        payloads = [p for _, d in events if isinstance(p := _json(d), dict)]
        if len(payloads) != len(events):
            return LOST, "an event that is not a JSON object"
        last = payloads[-1]
        if last.get("type") in ("response.completed", "response.incomplete"):
            return ANSWERED, ""
        if last.get("type") == "response.failed" or (last.get("type") == "error" and len(payloads) == 1):
            return (FAILED, "error event") if any(p.get("type") == "error" for p in payloads) else \
                (FAILED, "response.failed")
        if last.get("type") == "error":
            return FAILED, "error event"
        return LOST, f"ended on {last.get('type')!r}"
    if kind == "messages":
        name, data = events[-1]
        if name == "message_stop":
            return ANSWERED, ""
        if name == "error":
            return (FAILED, "error event") if error_shaped(kind, _json(data)) else (LOST, "a garbled error event")
        return LOST, f"ended on {name!r}"
    raise ValueError(f"no stream for {kind}")


def classify(kind: str, stream: bool, status: int | None, content_type: str, text: str, *,
             transport_error: str | None = None, cancelled: bool = False, server_down: bool = False,
             ingress_killed: bool = False) -> tuple[str, str]:
    """One request's outcome and why: see the module's docstring. `status` None: no response came."""
    if status is None:
        if server_down and transport_error == "connect":
            return REFUSED, "the server was down (this script's doing)"
        if ingress_killed and transport_error != "timeout":
            return CUT, "its ingress worker was killed"
        return LOST, f"no response ({transport_error})"
    if cancelled and status == 200:
        return CANCELLED, ""
    if transport_error is not None:  # the status came, the body did not
        if ingress_killed and transport_error != "timeout":
            return CUT, "its ingress worker was killed"
        return LOST, f"{status} then {transport_error}"
    if status >= 400:
        body = _json(text) if content_type.startswith("application/json") else None
        return (FAILED, str(status)) if error_shaped(kind, body) else (LOST, f"a {status} not in the dialect's shape")
    if status != 200:
        return LOST, f"status {status}"
    if stream:
        if not content_type.startswith("text/event-stream"):
            return LOST, f"a stream answered as {content_type!r}"
        return classify_stream(kind, text)
    body = _json(text)
    return (ANSWERED, "") if complete(kind, body) else (LOST, "an incomplete body")


# ---- the processes and their memory --------------------------------------------------------------------------

def memory_kib(pid: int) -> dict[str, int] | None:
    """VmRSS ("rss") and RssAnon ("anon", the private heap: where a leak shows) of a process, in KiB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmRSS:", "RssAnon:"))}
        return {"rss": fields["VmRSS"], "anon": fields["RssAnon"]}
    except (OSError, KeyError, ValueError, IndexError):
        return None


def compare_memory(baseline: dict[int, tuple[str, dict[str, int]]], end: dict[int, tuple[str, dict[str, int]]],
                   limit: float = 1.10) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], bool]:
    """Each process sampled at both ends (pid -> (title, memory_kib)): its start and end (anon: the judged
    figure; rss: shown), the totals of each role, and whether every process and every total ended within
    `limit` of its start. A process absent from either end (a worker killed, or one started since) is left out:
    its replacement has its own baseline."""
    rows: list[dict[str, Any]] = []
    for pid, (t, mem) in sorted(end.items(), key=lambda kv: (kv[1][0], kv[0])):
        if pid not in baseline:
            continue
        base = baseline[pid][1]
        rows.append({"process": t, "pid": pid, "start_mb": round(base["anon"] / 1024, 1),
                     "end_mb": round(mem["anon"] / 1024, 1), "ratio": round(mem["anon"] / base["anon"], 3),
                     "rss_start_mb": round(base["rss"] / 1024, 1), "rss_end_mb": round(mem["rss"] / 1024, 1)})
    totals = {}
    for role in ROLES:
        mine = [r for r in rows if r["process"].startswith(role)]
        if mine:
            a, b = sum(r["start_mb"] for r in mine), sum(r["end_mb"] for r in mine)
            totals[role] = {"start_mb": round(a, 1), "end_mb": round(b, 1), "ratio": round(b / a, 3),
                            "rss_start_mb": round(sum(r["rss_start_mb"] for r in mine), 1),
                            "rss_end_mb": round(sum(r["rss_end_mb"] for r in mine), 1)}
    ok = all(r["ratio"] <= limit for r in rows) and all(t["ratio"] <= limit for t in totals.values())
    return rows, totals, ok


def watched(server: Server) -> dict[int, str]:
    """pid -> role of this server's ingress, render and postproc processes (by process title)."""
    out = {}
    for pid in descendants(server.proc.pid):
        t = title(pid)
        for role in ROLES:
            if t.startswith(f"sluice: {role}"):
                out[pid] = t.removeprefix("sluice: ")
    return out


# ---- the load ------------------------------------------------------------------------------------------------

@dataclass
class Record:
    kind: str
    stream: bool
    start: float
    end: float
    outcome: str
    why: str
    epoch: int


@dataclass
class Stored:
    kind: str  # response | background | batch | chat
    id: str
    epoch: int


@dataclass
class State:
    url: str
    epoch: int = 0
    down: bool = False
    paused: threading.Event = field(default_factory=threading.Event)  # set: clients hold off
    stop: threading.Event = field(default_factory=threading.Event)
    ingress_kills: list[tuple[float, float]] = field(default_factory=list)
    down_spans: list[tuple[float, float]] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    stored: list[Stored] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    idle: dict[int, bool] = field(default_factory=dict)

    def overlaps(self, spans: list[tuple[float, float]], start: float, end: float) -> bool:
        return any(a <= end and start <= b for a, b in spans)


def _text(prompt_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(("river", "stone", "cloud", "lamp", "door", "tree", "sea")) for _ in range(prompt_words))


class Client:
    def __init__(self, n: int, st: State, timeout: float) -> None:
        self.n, self.st, self.timeout = n, st, timeout
        self.rng = random.Random(n)
        self.last_response: str | None = None
        self.last_outcome = ""

    def request(self, kind: str, method: str, path: str, body: dict | None = None, *,
                stream: bool = False, cancel_after: int | None = None) -> tuple[str, object]:
        """Sends one request, records its outcome; returns (outcome, the parsed JSON body or None)."""
        st = self.st
        start, epoch, url = time.monotonic(), st.epoch, st.url
        status, ctype, text, transport, cancelled = None, "", "", None, False
        try:
            if stream:
                with httpx.stream(method, url + path, json=body, timeout=self.timeout) as r:
                    status, ctype = r.status_code, r.headers.get("content-type", "")
                    parts, events = [], 0
                    for chunk in r.iter_text():
                        parts.append(chunk)
                        events += chunk.count("\n\n")
                        if cancel_after is not None and status == 200 and events >= cancel_after:
                            cancelled = True
                            break
                    text = "".join(parts)
            else:
                r = httpx.request(method, url + path, json=body, timeout=self.timeout)
                status, ctype, text = r.status_code, r.headers.get("content-type", ""), r.text
        except httpx.ConnectError:
            transport = "connect"
        except httpx.TimeoutException:
            transport = "timeout"
        except httpx.HTTPError as e:
            transport = type(e).__name__
        end = time.monotonic()
        if cancelled and classify_stream(kind, text)[0] == FAILED:  # it failed before the client left
            cancelled = False
        with st.lock:
            down = st.down or st.overlaps(st.down_spans, start, end)
            killed = st.overlaps(st.ingress_kills, start, end)
        outcome, why = classify(kind, stream, status, ctype, text, transport_error=transport, cancelled=cancelled,
                                server_down=down, ingress_killed=killed)
        with st.lock:
            st.records.append(Record(kind, stream, start, end, outcome, why, epoch))
        self.last_outcome = outcome
        body_json = _json(text) if outcome == ANSWERED and not stream else None
        if outcome == ANSWERED and stream and kind == "responses":
            for _, d in sse_events(text):
                p = _json(d)
                if isinstance(p, dict) and p.get("type") in ("response.completed", "response.incomplete"):
                    body_json = p.get("response")
        return outcome, body_json

    def keep(self, kind: str, obj: object) -> None:
        if isinstance(obj, dict) and isinstance(obj.get("id"), str):
            with self.st.lock:
                self.st.stored.append(Stored(kind, obj["id"], self.st.epoch))

    def one(self) -> None:
        rng = self.rng
        words = rng.randint(3, 40)
        user = [{"role": "user", "content": _text(words, rng)}]
        max_tokens = rng.choice((4, 8, 16, 32))
        stream = rng.random() < 0.5
        cancel = rng.randint(2, 6) if stream and rng.random() < 0.25 else None
        pick = rng.random()
        if pick < 0.2:
            store = rng.random() < 0.3
            body = {"model": MODEL, "messages": user, "max_tokens": max_tokens, "stream": stream, "store": store}
            outcome, obj = self.request("chat", "POST", "/v1/chat/completions", body, stream=stream,
                                        cancel_after=cancel)
            if store and not stream and outcome == ANSWERED:
                self.keep("chat", obj)
        elif pick < 0.32:
            body = {"model": MODEL, "prompt": _text(words, rng), "max_tokens": max_tokens, "stream": stream}
            self.request("completions", "POST", "/v1/completions", body, stream=stream, cancel_after=cancel)
        elif pick < 0.55:
            body = {"model": MODEL, "input": _text(words, rng), "max_output_tokens": max_tokens, "stream": stream}
            if self.last_response is not None and rng.random() < 0.5:
                body["previous_response_id"] = self.last_response
            outcome, obj = self.request("responses", "POST", "/v1/responses", body, stream=stream,
                                        cancel_after=cancel)
            if outcome == ANSWERED and isinstance(obj, dict):
                self.keep("response", obj)
                self.last_response = obj.get("id")
        elif pick < 0.62:
            body = {"model": MODEL, "input": _text(words, rng), "max_output_tokens": max_tokens, "background": True}
            outcome, obj = self.request("background", "POST", "/v1/responses", body)
            if outcome == ANSWERED:
                self.keep("background", obj)
                if rng.random() < 0.2 and isinstance(obj, dict):
                    self.request("retrieve", "POST", f"/v1/responses/{obj['id']}/cancel")
        elif pick < 0.9:
            body = {"model": MODEL, "messages": user, "max_tokens": max_tokens, "stream": stream}
            self.request("messages", "POST", "/v1/messages", body, stream=stream, cancel_after=cancel)
        elif pick < 0.95:
            reqs = [{"custom_id": f"c{i}", "params": {"model": MODEL, "max_tokens": max_tokens, "messages": user}}
                    for i in range(rng.randint(1, 3))]
            outcome, obj = self.request("batch", "POST", "/v1/messages/batches", {"requests": reqs})
            if outcome == ANSWERED:
                self.keep("batch", obj)
        else:  # read back something stored earlier, while the load runs
            with self.st.lock:
                pool = [s for s in self.st.stored if s.kind in ("response", "chat")]
            if pool:
                s = rng.choice(pool)
                path = f"/v1/responses/{s.id}" if s.kind == "response" else f"/v1/chat/completions/{s.id}"
                self.request("retrieve", "GET", path)

    def run(self, pause: float) -> None:
        st = self.st
        while not st.stop.is_set():
            if st.paused.is_set():
                st.idle[self.n] = True
                time.sleep(0.1)
                continue
            st.idle[self.n] = False
            self.one()
            # (a client whose connection was refused backs off, as one would)
            time.sleep(1.0 if self.last_outcome == REFUSED else self.rng.uniform(0, 2 * pause))
        st.idle[self.n] = True


# ---- the run -------------------------------------------------------------------------------------------------

class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state_dir = Path(tempfile.mkdtemp(prefix="sluice-soak-state-"))
        self.server = self.start()
        self.st = State(self.server.url)
        self.clients = [Client(i, self.st, args.timeout) for i in range(args.clients)]
        self.threads: list[threading.Thread] = []
        self.baseline: dict[int, tuple[str, int, dict[str, int]]] = {}  # pid -> (title, epoch, memory_kib)
        self.memory: list[dict] = []
        self.events: list[dict] = []
        self.t0 = self.down_since = time.monotonic()

    def start(self) -> Server:
        return Server("--state-dir", str(self.state_dir), "--render-workers", "2", "--postproc-workers", "2",
                      "--ingress-workers", "2")

    def log(self, what: str, **extra: object) -> None:
        entry = {"t_s": round(time.monotonic() - self.t0, 1), "event": what, **extra}
        self.events.append(entry)
        print(json.dumps(entry), flush=True)

    def quiet(self, seconds: float) -> None:
        """Pauses the load, waits until every client is between requests, then `seconds` more."""
        self.st.paused.set()
        deadline = time.monotonic() + self.args.timeout + 10
        while not all(self.st.idle.get(c.n, True) for c in self.clients) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(seconds)

    def resume(self) -> None:
        self.st.paused.clear()

    def sample_baselines(self, only_new: bool) -> None:
        self.quiet(self.args.quiet_start)
        for pid, t in watched(self.server).items():
            if only_new and pid in self.baseline:
                continue
            mem = memory_kib(pid)
            if mem is not None:
                self.baseline[pid] = (t, self.st.epoch, mem)
        alive = watched(self.server)
        self.log("baseline (anon MB)", processes={f"{t} (pid {pid})": round(m["anon"] / 1024, 1)
                                                  for pid, (t, e, m) in self.baseline.items()
                                                  if e == self.st.epoch and pid in alive})
        self.resume()

    def close_epoch(self) -> None:
        """The end-of-life sample of this server's processes, after a quiet period."""
        self.quiet(self.args.quiet_end)
        end = {pid: (t, m) for pid, t in watched(self.server).items() if (m := memory_kib(pid)) is not None}
        rows, totals, ok = compare_memory({pid: (t, m) for pid, (t, e, m) in self.baseline.items()}, end)
        self.memory.append({"epoch": self.st.epoch, "processes": rows, "totals": totals, "ok": ok})
        self.log("epoch end", epoch=self.st.epoch, totals=totals)

    def warm(self) -> None:
        self.resume()
        time.sleep(self.args.warmup)

    def kill_render(self) -> None:
        pid = stage_pids(self.server, "render")[1]
        os.kill(pid, signal.SIGKILL)
        self.log("kill -9 render 1", pid=pid)
        wait_restarted_index(self.server, "render", 1, pid)
        self.log("render 1 restarted")
        time.sleep(self.args.warmup)
        self.sample_baselines(only_new=True)

    def kill_postproc(self) -> None:
        pid = stage_pids(self.server, "postproc")[0]
        os.kill(pid, signal.SIGKILL)
        self.log("kill -9 postproc 0", pid=pid)
        wait_restarted(self.server, "postproc", pid)
        self.log("postproc 0 restarted")
        time.sleep(self.args.warmup)
        self.sample_baselines(only_new=True)

    def kill_ingress(self) -> None:
        workers = ingress_workers(self.server)
        start = time.monotonic()
        with self.st.lock:
            self.st.ingress_kills.append((start, start + 3600))
        os.kill(workers[0], signal.SIGKILL)
        self.log("kill -9 an ingress worker", pid=workers[0])
        deadline = time.monotonic() + 60
        while len(now := ingress_workers(self.server)) < len(workers) or workers[0] in now or \
                not all(title(p) == "sluice: ingress" for p in now):
            if time.monotonic() > deadline:
                raise AssertionError("the ingress worker was not respawned")
            time.sleep(0.2)
        with self.st.lock:
            self.st.ingress_kills[-1] = (start, time.monotonic())
        self.log("ingress worker respawned")
        time.sleep(self.args.warmup)
        self.sample_baselines(only_new=True)

    def go_down(self) -> None:
        self.down_since = time.monotonic()
        with self.st.lock:
            self.st.down = True

    def new_server(self, how: str) -> None:
        start = time.monotonic()
        self.server = self.start()
        with self.st.lock:
            self.st.url, self.st.down = self.server.url, False
            self.st.epoch += 1
            self.st.down_spans.append((self.down_since, time.monotonic()))
        self.log(f"server up again ({how})", epoch=self.st.epoch, took_s=round(time.monotonic() - start, 1))
        self.warm()
        self.sample_baselines(only_new=False)

    def kill_engine(self) -> None:
        self.close_epoch()
        self.resume()
        time.sleep(2)  # requests in flight when it dies
        old = self.server
        self.go_down()  # (the server exits once it has failed what was in flight: refusals are expected)
        os.kill(old.stage_pid("engine"), signal.SIGKILL)
        self.log("kill -9 engine")
        try:
            code = old.proc.wait(60)
        except Exception:  # noqa: BLE001 (it must exit: a hang is a finding)
            code = None
            old.stop(signal.SIGKILL)
        self.log("server exited after the engine kill", exit_code=code)
        self.new_server("after the engine kill")

    def restart(self) -> None:
        self.close_epoch()
        self.resume()
        time.sleep(2)
        self.go_down()  # (a request refused while it drains or stops is the restart's doing)
        code = self.server.stop(signal.SIGTERM, timeout=120)
        self.log("SIGTERM", exit_code=code)
        self.new_server("after SIGTERM")

    def verify_stored(self) -> dict:
        """Every stored object is there; background responses and batches are given time to finish."""
        url = self.server.url
        out: dict[str, dict] = {}
        deadline = time.monotonic() + self.args.settle
        for s in self.st.stored:
            row = out.setdefault(s.kind, {"count": 0, "retrieved": 0, "missing": [], "states": {}})
            row["count"] += 1
            path = {"response": f"/v1/responses/{s.id}", "background": f"/v1/responses/{s.id}",
                    "chat": f"/v1/chat/completions/{s.id}", "batch": f"/v1/messages/batches/{s.id}"}[s.kind]
            while True:
                try:
                    r = httpx.get(url + path, timeout=30)
                    body = r.json() if r.status_code == 200 else {}
                except (httpx.HTTPError, ValueError):
                    r, body = None, {}
                state = body.get("status") or body.get("processing_status")
                pending = state in ("queued", "in_progress", "cancelling")
                if r is not None and r.status_code == 200 and (not pending or time.monotonic() > deadline):
                    break
                if r is not None and r.status_code != 200:
                    break
                time.sleep(0.5)
            if r is not None and r.status_code == 200 and body.get("id") == s.id:
                row["retrieved"] += 1
                row["states"][str(state)] = row["states"].get(str(state), 0) + 1
                if s.kind == "batch" and state == "ended":
                    res = httpx.get(url + path + "/results", timeout=30)
                    lines = [ln for ln in res.text.splitlines() if ln.strip()]
                    if res.status_code != 200 or not lines:
                        row["missing"].append({"id": s.id, "results": res.status_code, "epoch": s.epoch})
            else:
                row["missing"].append({"id": s.id, "status": None if r is None else r.status_code, "epoch": s.epoch})
        return out

    def run(self) -> dict:
        a = self.args
        total = a.minutes * 60
        schedule = [(0.15, self.kill_render), (0.30, self.kill_postproc), (0.45, self.kill_ingress),
                    (0.60, self.kill_engine), (0.80, self.restart)]
        self.threads = [threading.Thread(target=c.run, args=(a.pause,), daemon=True) for c in self.clients]
        for t in self.threads:
            t.start()
        self.warm()
        self.sample_baselines(only_new=False)
        load_start = time.monotonic()
        for frac, event in schedule:
            wait = load_start + frac * total - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            event()
        wait = load_start + total - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.close_epoch()
        self.st.stop.set()
        for t in self.threads:
            t.join(a.timeout + 10)
        hung_clients = sum(t.is_alive() for t in self.threads)
        stored = self.verify_stored()
        counts: dict[str, int] = {}
        for r in self.st.records:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
        by_kind: dict[str, dict[str, int]] = {}
        for r in self.st.records:
            k = by_kind.setdefault(f"{r.kind}{' stream' if r.stream else ''}", {})
            k[r.outcome] = k.get(r.outcome, 0) + 1
        lost = [{"kind": r.kind, "stream": r.stream, "t_s": round(r.start - self.t0, 1), "why": r.why,
                 "epoch": r.epoch} for r in self.st.records if r.outcome == LOST]
        failed_why: dict[str, int] = {}
        failed_when = []  # (when each failure came: near a kill or not)
        for r in self.st.records:
            if r.outcome == FAILED:
                failed_why[f"{r.kind} {r.why}"] = failed_why.get(f"{r.kind} {r.why}", 0) + 1
                failed_when.append(f"{r.kind} {r.why} at {r.start - self.t0:.1f}-{r.end - self.t0:.1f} s")
        memory_ok = all(m["ok"] for m in self.memory)
        stored_ok = all(not row["missing"] and row["retrieved"] == row["count"] for row in stored.values())
        result = {"minutes": a.minutes, "clients": a.clients, "requests": len(self.st.records), "outcomes": counts,
                  "by_kind": by_kind, "failed_why": failed_why, "failed_when": failed_when[:100],
                  "lost": lost[:50], "hung_clients": hung_clients,
                  "stored": stored, "memory": self.memory, "events": self.events,
                  "ok": {"no_lost": not lost and hung_clients == 0, "stored": stored_ok, "memory": memory_ok}}
        self.server.stop()
        return result


def wait_restarted_index(server: Server, role: str, index: int, old_pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while stage_pids(server, role).get(index) == old_pid:
        if time.monotonic() > deadline:
            raise AssertionError(f"{role}[{index}] was not restarted")
        time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--quick", action="store_true", help="a 2-minute version (shorter warm-ups and quiet periods)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--pause", type=float, default=0.3, help="mean seconds a client waits between requests")
    p.add_argument("--timeout", type=float, default=120, help="a request still open after this is hung")
    p.add_argument("--out", help="write the result here as JSON")
    args = p.parse_args()
    if args.quick:
        args.minutes = 2
    long = not args.quick
    args.warmup, args.quiet_start, args.quiet_end = (30, 5, 60) if long else (8, 3, 10)
    args.settle = 300 if long else 90
    soak = Soak(args)
    try:
        result = soak.run()
    finally:
        soak.server.stop(signal.SIGKILL)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
