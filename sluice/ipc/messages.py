"""Messages between the stages, one tagged union per socket.

Token ids travel as raw little-endian int32 buffers (`bytes`), never as lists.
"""
from __future__ import annotations

import itertools
from typing import Literal

import msgspec
import numpy as np

from sluice.schemas.openai import DisaggregatedParams

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


def ids_to_bytes(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def bytes_to_ids(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i4")


class SamplingParams(msgspec.Struct, frozen=True, **_WIRE):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # Every id that ends the request: the user's stop_token_ids, the model's EOS
    # ids (unless ignore_eos) and the serving extension's extra stop ids.
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    bad_words_ids: list[list[int]] = []
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None  # top-k logprobs per sampled token (0: the sampled token's only)
    prompt_logprobs: int | None = None

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


# ---- ingress -> render -------------------------------------------------------

# What the client asked through: OpenAI chat / completions, Anthropic messages, OpenAI responses. Only the
# ingress (its routes and errors), render's translation and postproc's framing look at it.
Endpoint = Literal["chat", "completions", "messages", "responses", "generate"]  # generate: token ids out (gRPC)
Answer = Literal["engine", "count", "tokens", "text"]


class TraceContext(msgspec.Struct, **_WIRE):
    """A request's W3C trace context, as its client sent it (sluice/base/tracing.py)."""

    traceparent: str
    tracestate: str = ""


class RenderJob(msgspec.Struct, tag=True, **_WIRE):
    request_id: str
    endpoint: Endpoint
    body: bytes  # the JSON body, already validated by the ingress
    reply_to: str  # address of the ingress worker holding the connection (or of the background owner)
    arrival_time: float
    priority: int | None = None  # instead of the request's own: background work runs behind interactive
    # engine: generate. The others answer from the render alone: count the prompt's size ({"input_tokens": N}),
    # tokens its ids (/tokenize), text the body's `tokens` decoded (/detokenize)
    answer: Answer = "engine"
    disagg: DisaggregatedParams | None = None  # from the orchestrator (the ingress checked its secret)
    trace: TraceContext | None = None  # the client's traceparent / tracestate headers


# ---- render / ingress / postproc -> engine ----------------------------------

class EngineRequest(msgspec.Struct, tag=True, **_WIRE):
    request_id: str
    prompt_token_ids: bytes  # int32
    sampling: SamplingParams
    shard: int  # the postproc worker that owns this request
    postproc_spec: bytes  # opaque to the engine; forwarded with the first token
    arrival_time: float = 0.0
    n: int = 1  # choices sampled from the one prompt
    priority: int = 0  # lower is served first
    cache_salt: str = ""
    render_done_time: float = 0.0
    grammar: str = ""  # a compiled xgrammar grammar (serialized) that constrains the output
    grammar_trigger: list[int] = []  # the constraint applies once the output ends with these ids ([]: at once)
    grammar_param: str = ""  # the request field the grammar comes from (the engine's errors about it name it)
    kv: KvExport | KvImport | None = None  # disaggregated serving: this request's KV leaves or arrives
    prediction: bytes = b""  # int32: the client's predicted output (chat's `prediction`), a draft to verify


class KvExport(msgspec.Struct, tag=True, **_WIRE):
    """context_only: compute the prompt's KV and each choice's first token, keep the blocks under a lease for a
    generation worker, and answer `reply_to` with the transfer handle (the postproc pool never sees it)."""

    reply_to: str
    output_prefix_len: int = 0  # told back to the orchestrator with the prompt ids
    model: str = ""  # the answer's (the request's model)
    completion: bool = False  # the answer is a text_completion (else a chat.completion)
    disagg_request_id: int | None = None  # the orchestrator's id for the pair, told back
    prompt_b64: bool = False  # the answer gives the prompt ids as base64 int32 too


class KvImport(msgspec.Struct, tag=True, **_WIRE):
    """generation_only: the prompt's KV is where `handle` (ipc/kv.py KvHandle, encoded) says; each choice
    decodes on from its first token, sampled by the context worker."""

    handle: bytes
    first_tokens: bytes  # int32, one per choice
    num_cached_tokens: int = 0  # the context worker's prefix-cache hits (the usage reports them)
    # each choice's first token's logprobs, where the request asks for them: (token id, logprob, rank) of the
    # sampled token, then of each of the most likely ones, in order
    first_logprobs: list[list[tuple[int, float, int]]] = []
    prompt_logprobs: Logprobs | None = None  # of prompt positions 1.., the context worker's (prompt_logprobs)


class Abort(msgspec.Struct, tag=True, **_WIRE):
    """Ends whole requests whose output nobody will read (the client left, its deadline passed, a stage
    failed it). The engine frees them, and tells their postproc shard to forget them; a render worker stops
    rendering them."""

    request_ids: list[str]


class EndChoices(msgspec.Struct, tag=True, **_WIRE):
    """Ends single choices that their postproc shard has already finished (a stop string, malformed
    output): the engine frees them; the request's other choices go on."""

    choices: list[tuple[str, int]]  # (request_id, choice index)


class StepsTaken(msgspec.Struct, tag=True, **_WIRE):
    """A postproc shard took this many step messages off its socket (flow control: the engine runs at most
    --steps-ahead steps ahead of each shard)."""

    shard: int
    count: int


EngineInput = EngineRequest | Abort | EndChoices | StepsTaken
RenderInput = RenderJob | Abort  # (an abort stops its job's render: see render/deadline.py)


# ---- engine -> postproc ------------------------------------------------------

class Started(msgspec.Struct, **_WIRE):
    request_id: str
    postproc_spec: bytes
    num_prompt_tokens: int
    num_cached_tokens: int = 0


class Logprobs(msgspec.Struct, **_WIRE):
    """Raw logprobs of consecutive tokens: the chosen ones, their ranks, and the top-k alternatives."""

    logprobs: bytes  # float32[T]
    ranks: bytes  # int32[T]
    top_ids: bytes  # int32[T, k]
    top_logprobs: bytes  # float32[T, k]
    k: int


class PromptLogprobs(msgspec.Struct, **_WIRE):
    request_id: str
    start: int  # prompt position of the first scored token
    token_ids: bytes  # int32: the prompt tokens scored
    values: Logprobs


class Timings(msgspec.Struct, **_WIRE):
    """When a finished choice passed each stage (wall-clock seconds)."""

    request_id: str
    index: int
    arrival: float
    render_done: float
    first_scheduled: float
    first_token: float
    last_token: float


# stop_token: the token is one of the request's stop ids (not part of the output); grammar: the output is
# whole by its grammar, this token included; length: max_tokens or the context.
FinishReason = Literal["stop_token", "grammar", "length"]


class Finished(msgspec.Struct, **_WIRE):
    """The engine ended a choice on the token it sent for it in the same step."""

    request_id: str
    index: int
    reason: FinishReason


class Failed(msgspec.Struct, **_WIRE):
    """The engine could not go on with a request (every choice of it is gone from the engine)."""

    request_id: str
    message: str
    # 400: the request's own constraints leave its output no way on (`param` names the field); 500: the engine's
    status: int = 500
    param: str | None = None


class Predicted(msgspec.Struct, **_WIRE):
    """A choice's draft tokens of its prediction that a step verified: those its output kept, and the rest."""

    request_id: str
    index: int
    accepted: int
    rejected: int


class StepOutputs(msgspec.Struct, tag=True, **_WIRE):
    """One engine step's results for the requests one postproc shard owns."""

    started: list[Started]  # requests with their first output in this step
    request_ids: list[str]  # one new token each, for choice `indices[i]` (a drafted choice's several, in order)
    indices: bytes  # int32[len(request_ids)]
    token_ids: bytes  # int32[len(request_ids)]
    finished: list[Finished] = []
    aborted: list[str] = []  # whole requests freed on an Abort: nobody reads them, forget them
    failed: list[Failed] = []
    logprobs: list[tuple[int, Logprobs]] = []  # (position in request_ids, logprobs of that token)
    prompt_logprobs: list[PromptLogprobs] = []
    timings: list[Timings] = []  # for the choices in `finished`
    predicted: list[Predicted] = []  # for the choices drafted in this step


class IngressGone(msgspec.Struct, tag=True, **_WIRE):
    """An ingress worker died: drop (and abort) the requests whose frames go to it."""

    address: str


PostprocInput = StepOutputs | IngressGone


# ---- render / postproc -> ingress ------------------------------------------

class Failure(msgspec.Struct, **_WIRE):
    """A request that ends in an error, before its response began or during it. The ingress renders it in
    the request's dialect: an error body with this status, or an error event in a stream."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None


class Frame(msgspec.Struct, **_WIRE):
    request_id: str
    data: bytes  # SSE bytes for a stream; the whole body otherwise
    done: bool = False
    error: Failure | None = None  # the request ends in this error instead (with done, and no data)
    stored: bytes = b""  # a request the ingress stores (PostprocSpec.store): its whole body, in its last frame
    sequence: int = 0  # a Responses stream: the sequence number its next event takes (its events come before it)
    # The byte lengths of data's last len(sizes) events, as its framer wrote them: every event of a Responses
    # stream (stored one by one), the closing event of any stream's last frame (an error takes its place when
    # what ends cannot be stored). Nobody parses the SSE back.
    sizes: list[int] = []

    def events(self) -> list[bytes]:
        """data's last len(sizes) events, in order."""
        bounds = itertools.accumulate(self.sizes, initial=len(self.data) - sum(self.sizes))
        return [self.data[a:b] for a, b in itertools.pairwise(bounds)]


class Frames(msgspec.Struct, tag=True, **_WIRE):
    frames: list[Frame]


class Rendered(msgspec.Struct, tag=True, **_WIRE):
    """Render handed these requests to the engine: from now on they no longer depend on that worker."""

    request_ids: list[str]


IngressInput = Frames | Rendered


# ---- supervisor control ------------------------------------------------------

Role = Literal["engine", "render", "postproc", "background", "grpc"]


class Ready(msgspec.Struct, tag=True, **_WIRE):
    role: Role
    index: int
    pid: int
    cpu_compute: bool = False  # the engine: its model runs on this host's CPU (its kernels use every core)
    kv_events_port: int = 0  # the engine: the ports its KV sockets bound (0: none)
    kv_transfer_port: int = 0


class IngressStatus(msgspec.Struct, tag=True, **_WIRE):
    pid: int
    in_flight: int


SupervisorInput = Ready | IngressStatus


# Broadcasts from the supervisor to every ingress worker.

class Drain(msgspec.Struct, tag=True, **_WIRE):
    """SIGTERM: refuse new requests (503), let the ones in flight finish."""


class DrainTimedOut(msgspec.Struct, tag=True, **_WIRE):
    """The drain's --shutdown-timeout passed: end the requests still in flight."""

    timeout: float


class EngineDied(msgspec.Struct, tag=True, **_WIRE):
    """The engine process is gone: every request in flight fails, the server exits."""


class StageDied(msgspec.Struct, tag=True, **_WIRE):
    """A render or postproc worker died (it is being restarted): fail the requests that depended on it."""

    role: Literal["render", "postproc"]
    index: int


ControlInput = Drain | DrainTimedOut | EngineDied | StageDied


# ---- render -> postproc (carried opaquely by the engine) -------------------

ParserName = Literal["harmony", "think", "qwen3", "deepseek_r1", "hermes", "llama3_json", "mistral", "qwen3_coder",
                     "deepseek_v3", "pythonic", "granite"]


class PostprocSpec(msgspec.Struct, **_WIRE):
    request_id: str
    endpoint: Endpoint
    model: str
    created: int
    reply_to: str
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage so far in every chunk (with include_usage)
    parallel_tool_calls: bool = True  # False: the output ends after its first tool call
    include_reasoning: bool = True  # False: the reasoning parsed out of the output is not sent
    user: str | None = None  # the client's end-user id, for the request's log line
    stop: list[str] = []
    output_mode: Literal["text", "tokens"] = "text"
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    logprobs: bool = False  # report the sampled tokens' logprobs
    echo: str = ""  # text that starts each completion (completions' echo)
    prompt_token_ids_b64: str | None = None  # returned in the response when asked for
    dialect: bytes = b""  # what a dialect's framer needs beyond the above (msgpack, its own Struct)
    parsers: list[ParserName] = []  # chat output parsers, in order
    output_prefix: list[int] = []  # prompt tokens that begin the assistant's output (the parsers read them first)
    tool_param_types: dict[str, dict[str, str]] = {}  # function -> parameter -> JSON-schema type (qwen3_coder)
    return_token_ids: bool = False
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    arrival_time: float = 0.0
    perf_metrics: bool = False  # put each request's timings in its response
    stream_interval: int = 1  # a stream sends a frame every this many tokens (the first at once)
    store: bool = False  # the ingress stores the response: the last frame carries the whole body (Frame.stored)
    service_tier: bool = False  # the request named a tier: the response says the one it was served on
    trace: TraceContext | None = None  # the client's trace context (its log line, its spans)
    prediction: bool = False  # the request gave a predicted output: the usage counts its tokens kept and not
