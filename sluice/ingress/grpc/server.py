"""The gRPC door (`sluice serve --grpc PORT`): the SGLang model gateway's worker protocol
(sglang.grpc.scheduler.SglangScheduler, as pypi sglang-router 0.3.2 speaks it to `grpc://` workers).

The router renders, tokenizes, detokenizes and parses; this process takes its token ids straight to the
engine (no render: the prompt is already ids) and gets the output ids back from the postproc shard that owns
the request (endpoint `generate`, sluice/postproc/token_frames.py), as an ingress worker gets its frames
(sluice/ingress/pipeline.py: drain, deadlines, a dead engine or postproc worker, in-flight counts for the
supervisor). A cancelled RPC, or an Abort naming its request, aborts it in the engine."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator

import grpc
import zmq

from sluice.base.checkpoint import sampling_defaults
from sluice.base.config import ServerConfig
from sluice.ingress.grpc import sglang_scheduler_pb2 as pb
from sluice.ingress.grpc.requests import ModelFacts, Outputs, Refused, constraint, engine_request
from sluice.ingress.pipeline import TIMED_OUT, Pipeline
from sluice.ipc.messages import Frame, Ready, SupervisorInput
from sluice.ipc.token_frames import decode_chunks
from sluice.ipc.transport import PushChannel
from sluice.render.errors import RequestError
from sluice.render.structured import Constraint, GrammarCompiler, GrammarLimits
from sluice.render.tokenizer import load_tokenizer

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
ABORTED = object()  # in a request's queue: an Abort RPC named it
_STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 408: grpc.StatusCode.DEADLINE_EXCEEDED}
_RID_PREFIX = "grpc-"  # the engine's ids of the door's requests (apart from the HTTP API's)
log = logging.getLogger("sluice.grpc")


class Door:
    def __init__(self, cfg: ServerConfig, pipeline: Pipeline) -> None:
        self.cfg, self.pipeline = cfg, pipeline
        hf = cfg.hf_config()
        bundle = load_tokenizer(Path(cfg.model_path), cfg.chat_template)
        self.model = ModelFacts(cfg.served_model_names[0], cfg.max_model_len, hf["vocab_size"], bundle.eos_token_ids,
                                cfg.postproc_workers)
        self.grammars = GrammarCompiler(cfg.model_path, hf["vocab_size"], GrammarLimits(
            compile_timeout=cfg.grammar_compile_timeout, memory=cfg.grammar_memory,
            max_grammar_bytes=cfg.grammar_max_bytes), cfg.grammar_backend)
        # one thread: one compile at a time, even past a cancelled call (GrammarCompiler is not thread-safe)
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        tok = bundle.tokenizer
        defaults = sampling_defaults(cfg.model_path, cfg.generation_config)
        self.info = pb.GetModelInfoResponse(
            model_path=cfg.model_path, tokenizer_path=cfg.model_path, is_generation=True,
            preferred_sampling_params=json.dumps(defaults) if defaults else "", weight_version="default",
            served_model_name=self.model.served_name, max_context_length=cfg.max_model_len,
            vocab_size=hf["vocab_size"], model_type=hf.get("model_type", ""), eos_token_ids=bundle.eos_token_ids,
            pad_token_id=_token_id(tok, bundle.special_tokens.get("pad_token")),
            bos_token_id=_token_id(tok, bundle.special_tokens.get("bos_token")),
            max_req_input_len=cfg.max_model_len - 1, architectures=hf.get("architectures", []))

    async def generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        pipeline = self.pipeline
        rid = _RID_PREFIX + (request.request_id or uuid.uuid4().hex)
        try:
            if refusal := self._refusal(rid):
                raise refusal
            grammar, param = "", ""
            if (c := constraint(request.sampling_params)) is not None:
                grammar, param = await self._compile(c), c.param
            engine = engine_request(request, rid, pipeline.address, self.model, grammar, param)
        except Refused as e:
            await context.abort(e.code, e.message)
            return
        outputs = Outputs(request.request_id, engine.n, engine.sampling.stop_token_ids, request.stream,
                          request.return_logprob)
        q = pipeline.open(rid)
        try:
            pipeline.submit_engine(engine)
            while not outputs.done:
                item = await q.get()
                if q.nbytes > self.cfg.max_stream_buffer:  # its client reads slower than its tokens come: as HTTP's
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the client reads the stream too slowly "
                                        f"(more than --max-stream-buffer, {self.cfg.max_stream_buffer} bytes, waiting)")
                if item is ABORTED:
                    for response in outputs.aborted():
                        yield response
                    return
                if item is TIMED_OUT:
                    yield _error(request.request_id, 504, f"the request did not finish within --request-timeout "
                                 f"({self.cfg.request_timeout:g}s)")
                    return
                assert isinstance(item, Frame)
                if item.error is not None:
                    yield _error(request.request_id, item.error.status, item.error.message)
                    return
                for response in outputs.feed(decode_chunks(item.data)):
                    yield response
                if item.done:  # (every choice ended in it; one that had not is not waited for)
                    for response in outputs.aborted():
                        yield response
        finally:  # (a cancelled RPC ends here too: its generator is closed)
            if not outputs.done:
                pipeline.abort(rid)
            pipeline.close(rid)

    async def _compile(self, c: Constraint) -> str:
        """The constraint's grammar, compiled as the render compiles a response_format (its compile process, its
        limits, its cache), one at a time, off the event loop."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._compiler, self.grammars.compile, c)
        except RequestError as e:
            raise Refused(_STATUS_CODES.get(e.status, grpc.StatusCode.INTERNAL), e.message) from None

    def _refusal(self, rid: str) -> Refused | None:
        pipeline = self.pipeline
        if pipeline.draining:
            return Refused(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if problem := pipeline.health_problem():
            return Refused(grpc.StatusCode.UNAVAILABLE, problem)
        if pipeline.full:
            return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the server is full ({self.cfg.max_pending} requests "
                           "in flight); retry later")
        if rid in pipeline.pending:
            return Refused(grpc.StatusCode.ALREADY_EXISTS, f"request {rid[len(_RID_PREFIX):]!r} is in flight")
        return None

    async def health_check(self, request: pb.HealthCheckRequest,
                           context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        problem = "the server is shutting down" if self.pipeline.draining else self.pipeline.health_problem()
        return pb.HealthCheckResponse(healthy=problem is None, message=problem or "ok")

    async def abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        rid = _RID_PREFIX + request.request_id
        q = self.pipeline.pending.get(rid)
        if q is None:
            return pb.AbortResponse(success=False, message=f"request {request.request_id!r} is not in flight")
        self.pipeline.abort(rid)
        self.pipeline.end(rid, q, ABORTED)
        return pb.AbortResponse(success=True, message=f"request {request.request_id!r} aborted")

    async def get_model_info(self, request: pb.GetModelInfoRequest,
                             context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        return self.info


def _token_id(tokenizer, token: str | None) -> int:
    tid = tokenizer.token_to_id(token) if token else None
    return tid if tid is not None else 0


def _error(request_id: str, status: int, message: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=request_id,
                               error=pb.GenerateError(message=message, http_status_code=str(status)))


def service(door: Door) -> grpc.GenericRpcHandler:
    """The service's methods (no generated stubs: the messages' own codecs are all a handler needs)."""
    def unary(method, request_type, response_type) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(method, request_deserializer=request_type.FromString,
                                                   response_serializer=response_type.SerializeToString)

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            door.generate, request_deserializer=pb.GenerateRequest.FromString,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "HealthCheck": unary(door.health_check, pb.HealthCheckRequest, pb.HealthCheckResponse),
        "Abort": unary(door.abort, pb.AbortRequest, pb.AbortResponse),
        "GetModelInfo": unary(door.get_model_info, pb.GetModelInfoRequest, pb.GetModelInfoResponse),
    })


def run_grpc(cfg: ServerConfig) -> None:
    asyncio.run(_serve(cfg))


async def _serve(cfg: ServerConfig) -> None:
    pipeline = Pipeline(cfg)
    pipeline.start()
    # (SO_REUSEPORT, gRPC's default, binds beside the supervisor's hold on the port: sluice.ingress.grpc.hold_port)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", cfg.max_request_bytes)])
    server.add_generic_rpc_handlers((service(Door(cfg, pipeline)),))
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    port = server.add_insecure_port(f"{host}:{cfg.grpc_port}")
    if not port:
        raise SystemExit(f"sluice: gRPC: cannot listen on {host}:{cfg.grpc_port}")
    await server.start()
    log.info("gRPC (the SGLang model gateway's worker protocol) on %s:%d", host, port)
    PushChannel[SupervisorInput](zmq.Context.instance(), cfg.addresses.supervisor).put(Ready("grpc", 0, os.getpid()))
    await server.wait_for_termination()
