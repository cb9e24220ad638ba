"""The gRPC door's two translations: a router's GenerateRequest (token ids in) as the engine's request, and
the postproc's token frames (token ids out) as the router's GenerateResponses."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import msgspec

from sluice.ingress.grpc import sglang_scheduler_pb2 as pb
from sluice.ipc.addresses import shard_of
from sluice.ipc.messages import EngineRequest, PostprocSpec, SamplingParams, bytes_to_ids, ids_to_bytes
from sluice.ipc.token_frames import TokenChunk
from sluice.render.structured import Constraint, Kind

MAX_TOP_LOGPROBS = 20  # as the HTTP API's top_logprobs
_spec_encoder = msgspec.msgpack.Encoder()


class Refused(Exception):
    """A request the door does not take: the RPC ends with this status before anything is generated."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class ModelFacts:
    """What the door checks a request against and tells a router (GetModelInfo)."""

    served_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_shards: int


def constraint(sp: pb.SamplingParams) -> Constraint | None:
    """The request's structured-output constraint, for the render's grammar compiler (None: unconstrained)."""
    which = sp.WhichOneof("constraint")
    if which is None:
        return None
    if which == "structural_tag":
        raise Refused(grpc.StatusCode.UNIMPLEMENTED, "this server does not serve structural_tag constraints (regex, "
                      "json_schema and ebnf_grammar it does)")
    return Constraint(_KINDS[which], getattr(sp, which), f"sampling_params.{which}")


_KINDS: dict[str, Kind] = {"regex": "regex", "json_schema": "json_schema", "ebnf_grammar": "grammar"}


def engine_request(req: pb.GenerateRequest, rid: str, reply_to: str, model: ModelFacts, grammar: str = "",
                   grammar_param: str = "") -> EngineRequest:
    """`req` as the engine's request `rid`, its frames going to `reply_to`, its output held to `grammar` (the
    compiled constraint) where it has one (a Refused if it cannot be served here)."""
    _refuse_unsupported(req)
    prompt = list(req.tokenized.input_ids)
    if not prompt:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "tokenized.input_ids is empty")
    _check_ids(prompt, "tokenized.input_ids", model.vocab_size)
    sp = req.sampling_params
    max_tokens = _max_tokens(len(prompt), sp.max_new_tokens if sp.HasField("max_new_tokens") else None,
                             model.max_model_len)
    stop_ids = list(sp.stop_token_ids)
    _check_ids(stop_ids, "sampling_params.stop_token_ids", model.vocab_size)
    if not sp.ignore_eos:
        stop_ids.extend(model.eos_token_ids)
    top_logprobs = None
    if req.return_logprob:
        if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"top_logprobs_num must be within 0..{MAX_TOP_LOGPROBS}; got {req.top_logprobs_num}")
        top_logprobs = req.top_logprobs_num
    n = sp.n or 1
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=max(sp.temperature, 0.0),
        top_p=sp.top_p if 0 < sp.top_p <= 1 else 1.0,
        top_k=sp.top_k if 0 < sp.top_k < model.vocab_size else 0,  # the gateway's -1 (off) is our 0
        min_p=sp.min_p,
        stop_token_ids=tuple(dict.fromkeys(stop_ids)),
        min_tokens=min(max(sp.min_new_tokens, 0), max_tokens),
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty or 1.0,
        logit_bias=_logit_bias(dict(sp.logit_bias), model.vocab_size),
        logprobs=top_logprobs,
    )
    now = time.time()
    shard = shard_of(rid, model.num_shards)
    spec = PostprocSpec(request_id=rid, endpoint="generate", model=model.served_name, created=int(now),
                        reply_to=reply_to, stream=True, stop=list(sp.stop), include_stop_str_in_output=sp.no_stop_trim,
                        skip_special_tokens=False, n=n, logprobs=req.return_logprob, arrival_time=now)
    return EngineRequest(request_id=rid, prompt_token_ids=ids_to_bytes(prompt), sampling=sampling, shard=shard,
                         postproc_spec=_spec_encoder.encode(spec), arrival_time=now, n=n, render_done_time=now,
                         grammar=grammar, grammar_param=grammar_param)


def _refuse_unsupported(req: pb.GenerateRequest) -> None:
    mm = req.mm_inputs
    unsupported = [
        (bool(mm.image_urls or mm.video_urls or mm.audio_urls or mm.image_data or mm.video_data or mm.audio_data),
         "multimodal inputs"),
        (bool(req.input_embeds), "input_embeds"),
        (bool(req.lora_id), "LoRA adapters (lora_id)"),
        (req.return_hidden_states, "return_hidden_states"),
        (bool(req.custom_logit_processor), "custom_logit_processor"),
        (bool(req.token_ids_logprob), "token_ids_logprob"),
        (bool(req.disaggregated_params.bootstrap_host), "the gateway's prefill/decode bootstrap "
         "(disaggregated_params): Sluice hands KV over through its own router, `sluice router`"),
    ]
    for present, what in unsupported:
        if present:
            raise Refused(grpc.StatusCode.UNIMPLEMENTED, f"this server does not serve {what}")


def _check_ids(ids: list[int], name: str, vocab_size: int) -> None:
    if bad := [i for i in ids if i >= vocab_size]:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{name} has ids past the vocabulary ({vocab_size} tokens): {bad[:5]}")


def _max_tokens(prompt_len: int, asked: int | None, limit: int) -> int:
    if prompt_len >= limit:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"This model's maximum context length is {limit} tokens; "
                      f"the prompt has {prompt_len}")
    if asked is None:
        return limit - prompt_len
    if asked < 1 or prompt_len + asked > limit:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"max_new_tokens must be at least 1 and fit the context: {prompt_len} prompt tokens + {asked} "
                      f"exceed this model's maximum context length of {limit} tokens" if asked >= 1
                      else f"max_new_tokens must be at least 1; got {asked}")
    return asked


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    try:
        out = {int(k): v for k, v in bias.items()}
    except ValueError:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "logit_bias keys are token ids") from None
    _check_ids(list(out), "sampling_params.logit_bias", vocab_size)
    return out


# ---- token frames -> GenerateResponses -------------------------------------------------------------------


@dataclass
class _Choice:
    ids: list[int] = field(default_factory=list)  # the output so far (a whole output gathers them all)
    logprobs: list[tuple[float, list[int], list[float]]] = field(default_factory=list)
    num_tokens: int = 0  # generated tokens, a stop token included (the usage counts it, as the HTTP API's)
    done: bool = False


class Outputs:
    """One request's responses: streamed, a chunk per frame of new ids and a GenerateComplete per choice; else
    each choice's whole output in its GenerateComplete."""

    def __init__(self, request_id: str, n: int, stop_token_ids: tuple[int, ...], stream: bool, logprobs: bool) -> None:
        self.request_id = request_id
        self.stream, self.with_logprobs = stream, logprobs
        self.stop_token_ids = frozenset(stop_token_ids)
        self.choices = [_Choice() for _ in range(n)]
        self.num_prompt_tokens = self.num_cached_tokens = 0

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def feed(self, chunks: list[TokenChunk]) -> list[pb.GenerateResponse]:
        out = []
        for c in chunks:
            self.num_prompt_tokens, self.num_cached_tokens = c.num_prompt_tokens, c.num_cached_tokens
            choice = self.choices[c.index]
            ids = bytes_to_ids(c.token_ids).tolist()
            logprobs = list(c.logprobs)
            choice.num_tokens += len(ids)
            matched_token = None
            # A stop token ends the output without being part of it: the router learns which one it was.
            if c.finish_reason == "stop" and c.stop is None and ids and ids[-1] in self.stop_token_ids:
                matched_token = ids.pop()
                logprobs = logprobs[:len(ids)]
            choice.ids += ids
            choice.logprobs += logprobs
            if self.stream and ids:
                out.append(pb.GenerateResponse(request_id=self.request_id, chunk=pb.GenerateStreamChunk(
                    token_ids=ids, prompt_tokens=self.num_prompt_tokens, completion_tokens=choice.num_tokens,
                    cached_tokens=self.num_cached_tokens, output_logprobs=self._logprobs(logprobs, ids),
                    index=c.index)))
            if c.finish_reason is not None:
                out.append(self._complete(c.index, _finish_reason(c.finish_reason), matched_token, c.stop))
        return out

    def aborted(self) -> list[pb.GenerateResponse]:
        """A GenerateComplete, finish_reason "abort", for each choice still going."""
        return [self._complete(i, "abort") for i, c in enumerate(self.choices) if not c.done]

    def _complete(self, index: int, finish_reason: str, matched_token: int | None = None,
                  matched_stop: str | None = None) -> pb.GenerateResponse:
        choice = self.choices[index]
        choice.done = True
        complete = pb.GenerateComplete(
            output_ids=[] if self.stream else choice.ids, finish_reason=finish_reason,
            prompt_tokens=self.num_prompt_tokens, completion_tokens=choice.num_tokens,
            cached_tokens=self.num_cached_tokens, index=index,
            output_logprobs=None if self.stream else self._logprobs(choice.logprobs, choice.ids))
        if matched_token is not None:
            complete.matched_token_id = matched_token
        elif matched_stop is not None:
            complete.matched_stop_str = matched_stop
        return pb.GenerateResponse(request_id=self.request_id, complete=complete)

    def _logprobs(self, entries: list[tuple[float, list[int], list[float]]],
                  ids: list[int]) -> pb.OutputLogProbs | None:
        if not self.with_logprobs or not entries:
            return None
        return pb.OutputLogProbs(token_logprobs=[e[0] for e in entries], token_ids=ids,
                                 top_logprobs=[pb.TopLogProbs(values=e[2], token_ids=e[1]) for e in entries])


def _finish_reason(reason: str) -> str:
    """The gateway's words: stop, length or abort."""
    return "length" if reason == "length" else "stop"
