"""The router's ASGI app (granian, as the ingress): every dialect's generation route chooses a worker (or a
context worker then a generation worker) and relays the response as bytes; the other /v1 routes go to a
worker as they are (a stored object's id is looked for on each worker in turn)."""
from __future__ import annotations

import asyncio
import logging
import os
import time

import aiohttp
import msgspec

from sluice.base.auth import CHALLENGE, MISSING_KEY, authorized
from sluice.base.disagg import PARAMS_HEADER, SECRET_HEADER
from sluice.ingress.formats import BadMsgpack, msgpack_as_json, sends_msgpack
from sluice.ipc.kv import block_hashes
from sluice.router.config import RouterConfig
from sluice.router.metrics import CACHE_HIT_TOKENS, CONTEXT_SECONDS, DECISIONS, PROMPT_TOKENS, REQUESTS
from sluice.router.metrics import render as render_metrics
from sluice.router.policy import KvIndex, Policy
from sluice.router.prompts import Prompts
from sluice.router.relay import HOP, TRANSPORT, Failed, Relay, error, read_body, respond, str_headers
from sluice.router.workers import Worker, Workers

log = logging.getLogger("sluice.router")
GENERATION = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages",
              "/v1/responses": "responses"}
_BODY_PARAMS = ("/v1/chat/completions", "/v1/completions")  # dialects whose body has disaggregated_params
_ORCHESTRATOR_FIELDS = ("disaggregated_params", "kv_hints")
_MAX_PARAMS_HEADER = 16 << 10  # a longer handle (a very long prompt's ids) goes in a body, or is not split
_KEYS = {b"authorization", b"x-api-key"}
_json = msgspec.json.Encoder()


class _Refused(msgspec.Struct):
    """A context worker's 4xx for the request itself: relayed to the client as it is."""

    status: int
    body: bytes
    content_type: str | None


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.index = KvIndex()
        self.policy = Policy(cfg.policy, cfg.overlap_weight, cfg.balance_abs_threshold, cfg.balance_rel_threshold)
        kinds = {"replica": cfg.workers, "context": cfg.context, "generation": cfg.generation}
        self.api_keys = [k.encode() for k in cfg.api_keys]
        # what a worker is sent in place of the client's own key (none given: the client's key is relayed)
        self._worker_auth = [(b"authorization", b"Bearer " + cfg.worker_api_key.encode())] \
            if cfg.worker_api_key else []
        self.workers = Workers(kinds, self.index, cfg.health_interval, cfg.health_failures, self._worker_auth)
        self.relay = Relay(self.workers)
        self.prompts = Prompts(cfg.model)
        self.client: aiohttp.ClientSession | None = None  # (made in the event loop, at start)
        self._started: asyncio.Future | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Once, before the first request: the workers checked, the tokenizer loaded, the health loop on."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        # aiohttp: its C parser relays a streamed response for a fraction of httpx's CPU
        # (bench/RESULTS.md#kv-aware-routing)
        self.client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=self.cfg.request_timeout),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30), auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"), cookie_jar=aiohttp.DummyCookieJar())
        self.workers.client = self.relay.client = self.client
        await asyncio.gather(*(self.workers.check(w) for w in self.workers.all))
        self.prompts.start([w.model_root for w in self.workers.all])
        self._tasks = [asyncio.create_task(self.workers.run())]

    # ---- ASGI -----------------------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await self.start()
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    for task in self._tasks:
                        task.cancel()
                    self.workers.close()
                    if self.client is not None:
                        await self.client.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        await self.start()
        path, method = scope["path"], scope["method"]
        status = 0
        try:
            if not authorized(path, scope["headers"], self.api_keys, self.cfg.protect_metrics):
                status = await error(send, path, 401, MISSING_KEY, "invalid_api_key", extra=(CHALLENGE,))
            elif path in GENERATION and method == "POST":
                status = await self.generate(scope, receive, send)
            elif path in ("/health", "/ready"):
                ok = any(w.up for w in self.workers.all)
                status = await (respond(send, 200, b"{}") if ok else error(send, path, 503, "no worker"))
            elif path == "/metrics":
                status = await respond(send, 200, render_metrics(self.workers.all), b"text/plain; version=0.0.4")
            else:
                status = await self.forward(scope, receive, send)
        finally:
            if path.startswith("/v1/"):
                REQUESTS.labels(path if path in GENERATION else "other", str(status)).inc()

    # ---- generation -----------------------------------------------------------------------------------------

    async def generate(self, scope, receive, send) -> int:
        path = scope["path"]
        body = await read_body(receive, self.cfg.max_request_bytes)
        if body is None:
            return await error(send, path, 413, "request body too large")
        headers = self._to_worker(scope["headers"])
        if sends_msgpack(scope["headers"]):  # read (and sent on) as the JSON body with the same fields
            try:
                body = msgpack_as_json(body)
            except BadMsgpack as e:
                return await error(send, path, 400, f"the request body is not valid msgpack: {e}")
            headers = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"x-trtllm-msgpack")]
            headers.append((b"content-type", b"application/json"))
        if (claimed := _claims_hand_off(path, body)) is not None:
            return await error(send, path, 403, f"{claimed} are the router's own: clients do not send them",
                                "forbidden")
        ids, salt = await self.prompts.ids(GENERATION[path], body)
        affinity = _affinity(body)
        if self.cfg.disaggregated:
            return await self._disaggregated(path, body, headers, ids, salt, receive, send)
        tried: set[str] = set()
        while candidates := [w for w in self.workers.up("replica") if w.url not in tried]:
            worker, hashes, new = self._choose(candidates, ids, salt, affinity)
            tried.add(worker.url)
            try:
                return await self.relay.relay(worker, path, body, headers, receive, send, new)
            except Failed:
                continue
        return await error(send, path, 503, "no worker is up; retry shortly", retry=True)

    def _choose(self, workers: list[Worker], ids: list[int] | None, salt: str,
                affinity: str | None = None) -> tuple[Worker, list[bytes], int]:
        """The worker, the prompt's block hashes, and the blocks it must compute (its load until done)."""
        hashes = block_hashes(ids, salt, workers[0].block_size) if ids else []
        choice = self.policy.choose([w.url for w in workers], hashes, self.index, {w.url: w.load for w in workers},
                                    affinity)
        DECISIONS.labels(choice.reason).inc()
        if ids:
            PROMPT_TOKENS.inc(len(ids))
            CACHE_HIT_TOKENS.inc(choice.overlap * workers[0].block_size)
        return self.workers.by_url(choice.worker), hashes, len(hashes) - choice.overlap + 1

    async def _disaggregated(self, path: str, body: bytes, headers: list, ids: list[int] | None, salt: str,
                             receive, send) -> int:
        """A context worker computes the prompt's KV and first token, a generation worker decodes on from them;
        the prompt goes straight to the generation worker when little of it is new there (--max-local-prefill),
        when it cannot be split (the Responses API, a stored conversation), or when no context worker can."""
        gens = self.workers.up("generation")
        if not gens:
            return await error(send, path, 503, "no generation worker is up", retry=True)
        gen, hashes, new = self._choose(gens, ids, salt)
        uncached = len(ids) - (len(hashes) + 1 - new) * gen.block_size if ids else None
        ctxs = self.workers.up("context")
        if uncached is None or uncached <= self.cfg.max_local_prefill or not ctxs or path == "/v1/responses":
            DECISIONS.labels("local_prefill").inc()
            return await self.relay.relay_or_fail(gen, path, body, headers, receive, send, new)
        ctx, _, ctx_new = self._choose(ctxs, ids, salt)
        params = await self._context(ctx, path, body, headers, ctx_new)
        if isinstance(params, _Refused):  # the request itself is wrong: the client hears why
            return await respond(send, params.status, params.body, params.content_type)
        if params is None:  # the context worker failed: the generation worker does it all
            DECISIONS.labels("context_failed").inc()
            return await self.relay.relay_or_fail(gen, path, body, headers, receive, send, new)
        DECISIONS.labels("disaggregated").inc()
        params["request_type"] = "generation_only"
        gen_body, gen_headers = _with_params(path, body, headers, params)
        if gen_body is None:
            DECISIONS.labels("local_prefill").inc()
            return await self.relay.relay_or_fail(gen, path, body, headers, receive, send, new)
        return await self.relay.relay_or_fail(gen, path, gen_body, gen_headers + self._secret(), receive, send, 1,
                                         transfer=True, plain=body)

    async def _context(self, ctx: Worker, path: str, body: bytes, headers: list,
                       blocks: int) -> dict | _Refused | None:
        """The context worker's disaggregated_params; its answer when it refuses the request (4xx); None when
        it failed."""
        ctx_body, ctx_headers = _with_params(path, body, headers, {"request_type": "context_only"})
        assert ctx_body is not None
        t0 = time.perf_counter()
        ctx.load.add(blocks)
        try:
            async with self.relay.post(ctx.url + path, ctx_body, ctx_headers + self._secret()) as r:
                status, content, ctype = r.status, await r.read(), r.headers.get("content-type")
        except TRANSPORT as e:
            self.workers.take_out(ctx, f"a request failed: {e!r}")
            return None
        finally:
            ctx.load.done(blocks)
        CONTEXT_SECONDS.observe(time.perf_counter() - t0)
        # (a worker that does not know the field, an older one, is skipped: None below)
        if 400 <= status < 500 and b"disaggregated_params" not in content:
            return _Refused(status, content, ctype)
        try:  # (TensorRT-LLM's shape: the one choice carries them)
            return msgspec.json.decode(content)["choices"][0]["disaggregated_params"] if status == 200 else None
        except (msgspec.DecodeError, KeyError, IndexError, TypeError):
            return None

    def _secret(self) -> list[tuple[bytes, bytes]]:
        return [(SECRET_HEADER, (self.cfg.disagg_secret or "").encode())]

    def _to_worker(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The client's headers a worker gets: never a client's own disaggregation headers, and the router's
        --worker-api-key in place of the client's key where it has one."""
        drop = HOP | _KEYS if self._worker_auth else HOP
        return [(k, v) for k, v in headers if k.lower() not in drop] + self._worker_auth

    # ---- everything else --------------------------------------------------------------------------------------

    async def forward(self, scope, receive, send) -> int:
        """/v1/models, stored responses, batches, count_tokens...: to a worker as they are. A path that names
        an object (a 404 from one worker) is tried on the next."""
        path, method = scope["path"], scope["method"]
        body = await read_body(receive, self.cfg.max_request_bytes) or b""
        query = scope.get("query_string", b"").decode("latin-1")
        url_path = path + ("?" + query if query else "")
        workers = self.workers.up("replica") or self.workers.up("generation")
        assert self.client is not None
        answer = None
        for w in workers:
            try:
                async with self.client.request(method, w.url + url_path, data=body,
                                               headers=str_headers(self._to_worker(scope["headers"]))) as r:
                    answer = r.status, [(k, v) for k, v in r.raw_headers if k.lower() not in HOP], await r.read()
            except TRANSPORT as e:
                self.workers.take_out(w, f"a request failed: {e!r}")
                continue
            if answer[0] != 404:
                break
        if answer is None:
            return await error(send, path, 503, "no worker is up; retry shortly", retry=True)
        await send({"type": "http.response.start", "status": answer[0], "headers": answer[1]})
        await send({"type": "http.response.body", "body": answer[2]})
        return answer[0]


class _Affinity(msgspec.Struct):
    prompt_cache_key: str | None = None


_affinity_of = msgspec.json.Decoder(_Affinity)


def _affinity(body: bytes) -> str | None:
    """The request's prompt_cache_key (OpenAI's routing hint: requests that share one share a replica)."""
    try:
        return _affinity_of.decode(body).prompt_cache_key
    except msgspec.MsgspecError:  # (the worker answers what is wrong with it)
        return None


def _claims_hand_off(path: str, body: bytes) -> str | None:
    """The orchestrator's own fields a client's body carries (only the router, holding the workers' secret,
    sends them): disaggregated_params, and kv_hints, which steer what the workers' caches keep."""
    if path not in _BODY_PARAMS or not any(name.encode() in body for name in _ORCHESTRATOR_FIELDS):
        return None
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    claimed = [name for name in _ORCHESTRATOR_FIELDS if isinstance(data, dict) and name in data]
    return " and ".join(claimed) or None


def _with_params(path: str, body: bytes, headers: list, params: dict) -> tuple[bytes | None, list]:
    """The request with disaggregated_params: in its body where the dialect has the field, else in a header
    (None: too long for one)."""
    if path in _BODY_PARAMS:
        data = msgspec.json.decode(body)
        data["disaggregated_params"] = params
        return _json.encode(data), headers
    raw = _json.encode(params)
    if len(raw) > _MAX_PARAMS_HEADER:
        return None, headers
    return body, headers + [(PARAMS_HEADER, raw)]


def create_app() -> Router:
    """granian's factory: one Router per worker process."""
    from sluice.base import procs
    from sluice.base.logs import setup_logging

    procs.die_with_parent()  # with granian's main process (`sluice router`), however it dies
    procs.set_title("sluice: router")
    cfg = msgspec.json.decode(os.environ["SLUICE_ROUTER_CONFIG"].encode(), type=RouterConfig)
    setup_logging(f"router[{os.getpid()}]", "text")
    return Router(cfg)

