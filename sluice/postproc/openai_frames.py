"""OpenAI chat / completions output for one request: SSE frames or one body."""
from __future__ import annotations

from typing import Any, Callable

import msgspec
import numpy as np

from sluice.ipc.messages import Logprobs, PostprocSpec
from sluice.postproc.assembly import Assembly
from sluice.postproc.framers import FRAMERS, Framer
from sluice.postproc.parsers import Piece
from sluice.schemas.openai import (ChatChoice, ChatCompletion, ChatCompletionChunk, ChatLogprobs, ChunkChoice,
                                   Completion, CompletionChoice, CompletionLogprobs, CompletionTokensDetails, Delta,
                                   FunctionCallOut, PerfMetrics, PredictedUsage, PromptLogprob, PromptTokensDetails,
                                   ResponseMessage, TokenLogprob, ToolCallOut, TopLogprob, Usage)

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
TokenText = Callable[[int], str]


def sse(obj) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def unpack(lp: Logprobs) -> list[tuple[float, int, list[int], list[float]]]:
    """(logprob, rank, top ids, top logprobs) per token."""
    values = np.frombuffer(lp.logprobs, dtype=np.float32).tolist()
    ranks = np.frombuffer(lp.ranks, dtype="<i4").tolist()
    top_ids = np.frombuffer(lp.top_ids, dtype="<i4").reshape(len(values), lp.k).tolist()
    top_lps = np.frombuffer(lp.top_logprobs, dtype=np.float32).reshape(len(values), lp.k).tolist()
    return list(zip(values, ranks, top_ids, top_lps))


class OpenAIFramer(Framer):
    def __init__(self, spec: PostprocSpec, num_prompt_tokens: int, num_cached_tokens: int, text_of: TokenText) -> None:
        self.spec = spec
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens
        self.text_of = text_of
        self._chat = spec.endpoint == "chat"
        self._opened = [False] * spec.n  # a choice's first chunk went out
        self._messages = [Assembly(trim=False) for _ in range(spec.n)]  # non-streaming: each choice's items
        self._logprobs: list[list[tuple[int, tuple]]] = [[] for _ in range(spec.n)]
        self._token_ids: list[list[int]] = [[] for _ in range(spec.n)]
        self._finish: list[str | None] = [None] * spec.n
        self.prompt_logprobs: list | None = None
        # A plain chunk is this request's constant envelope around one encoded choice: encode it once.
        envelope = _json.encode(self._envelope([]))
        cut = envelope.index(b'"choices":[') + len(b'"choices":[')
        self._head, self._tail = b"data: " + envelope[:cut], envelope[cut:] + b"\n\n"
        # Most chat chunks carry one kind of text and nothing else: their bytes around the text are constant.
        self._plain = self._chat and not spec.continuous_usage and not spec.return_token_ids
        self._text_parts: dict[tuple[int, bool], tuple[bytes, bytes]] = {}  # (index, reasoning) -> around the text

    def usage(self, completion_tokens: int) -> Usage:
        p = self.num_prompt_tokens
        if self.spec.prediction:
            details = CompletionTokensDetails(self.reasoning_tokens, self.accepted_prediction_tokens,
                                              self.rejected_prediction_tokens)
            return PredictedUsage(p, completion_tokens, p + completion_tokens,
                                  PromptTokensDetails(self.num_cached_tokens), details)
        return Usage(p, completion_tokens, p + completion_tokens, PromptTokensDetails(self.num_cached_tokens))

    # ---- streaming -------------------------------------------------------------

    def chunk(self, index: int, piece: Piece, finish_reason: str | None, logprobs: list[tuple[int, tuple]],
              token_ids: list[int], completion_tokens: int = 0) -> bytes:
        """SSE bytes for one choice this step (empty when there is nothing to say); with continuous usage,
        each chunk carries the usage so far (`completion_tokens` of the whole request)."""
        out = b""
        if not self.spec.include_reasoning:
            piece.reasoning = ""
        if self._plain and self._opened[index] and not (finish_reason or logprobs or piece.tool_calls):
            if not piece.reasoning:
                return self._text_chunk(index, piece.content, False) if piece.content else b""
            if not piece.content:
                return self._text_chunk(index, piece.reasoning, True)
        opening = not self._opened[index]
        usage = self.usage(completion_tokens) if self.spec.continuous_usage else None
        if opening:
            self._opened[index] = True
            if self._chat:
                out += sse(self._envelope([ChunkChoice(index, Delta(role="assistant", content=""))], usage=usage,
                                          first=True))
            piece.content = self.spec.echo + piece.content
        if piece or finish_reason or logprobs or (opening and not self._chat):
            lp = self._format_logprobs(logprobs, offset=0) if logprobs else None
            ids = token_ids if self.spec.return_token_ids else None
            choice: ChunkChoice | CompletionChoice
            if self._chat:
                delta = Delta(content=piece.content or None, reasoning_content=piece.reasoning or None,
                              tool_calls=piece.tool_calls or None)
                choice = ChunkChoice(index, delta, finish_reason, lp, ids)
            else:
                choice = CompletionChoice(index, piece.content, finish_reason, lp, token_ids=ids)
            if (opening and not self._chat) or usage is not None:  # the per-request extras, the usage
                out += sse(self._envelope([choice], usage=usage, first=opening and not self._chat))
            else:
                out += self._head + _json.encode(choice) + self._tail
        return out

    def text_chunk(self, index: int, piece: Piece) -> bytes | None:
        """What `chunk` frames for an opened choice whose piece is text of one kind alone (content, or
        reasoning shown), with nothing else to say; None for any other piece (`chunk` it)."""
        if not self._plain or not self._opened[index] or piece.tool_calls:
            return None
        reasoning = piece.reasoning if self.spec.include_reasoning else ""
        if piece.content:
            return None if reasoning else self._text_chunk(index, piece.content, False)
        return self._text_chunk(index, reasoning, True) if reasoning else None

    def _text_chunk(self, index: int, text: str, reasoning: bool) -> bytes:
        """The chunk of choice `index` whose delta is `text` alone (content, or reasoning), nothing else."""
        parts = self._text_parts.get((index, reasoning))
        if parts is None:
            encoded = _json.encode(ChunkChoice(index, Delta(reasoning_content="") if reasoning else Delta(content="")))
            cut = encoded.index(b'""')
            parts = self._text_parts[index, reasoning] = (self._head + encoded[:cut], encoded[cut + 2:] + self._tail)
        return parts[0] + _json.encode(text) + parts[1]

    def end(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        """The stream's tail: the usage chunk when asked for (with the timings when asked for), then [DONE]."""
        self.closing = len(DONE)
        if self.spec.include_usage or perf is not None:
            usage = self.usage(completion_tokens) if self.spec.include_usage else None
            return sse(self._envelope([], usage=usage, perf=perf)) + DONE
        return DONE

    # ---- one body --------------------------------------------------------------

    def add(self, index: int, piece: Piece, logprobs: list[tuple[int, tuple]], token_ids: list[int],
            finish_reason: str | None) -> None:
        if not self.spec.include_reasoning:
            piece.reasoning = ""
        self._messages[index].feed(piece)
        self._logprobs[index] += logprobs
        self._token_ids[index] += token_ids
        if finish_reason:
            self._finish[index] = finish_reason

    def body(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        s = self.spec
        ids: list[list[int]] | list[None] = self._token_ids if s.return_token_ids else [None] * s.n
        choices: list[ChatChoice] | list[CompletionChoice]
        if self._chat:
            choices = [ChatChoice(i, _message(m), self._finish[i], self._lp(i, 0), ids[i])
                       for i, m in enumerate(self._messages)]
        else:
            choices = [CompletionChoice(i, s.echo + _text(m, "text"), self._finish[i], self._lp(i, len(s.echo)),
                                        self.prompt_logprobs, ids[i]) for i, m in enumerate(self._messages)]
        return _json.encode(self._envelope(choices, self.usage(completion_tokens), first=True, perf=perf,
                                           whole=True))

    # ---- pieces ----------------------------------------------------------------

    def add_prompt_logprobs(self, start: int, prompt_ids: list[int], entries: list[tuple]) -> None:
        """entries score prompt positions start, start+1, ...; position 0 has nothing to score."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        assert len(self.prompt_logprobs) == start, "prompt logprob chunks out of order"
        for token, (lp, rank, top_ids, top_lps) in zip(prompt_ids, entries):
            scored = {str(t): PromptLogprob(v, i + 1, self.text_of(t))
                      for i, (t, v) in enumerate(zip(top_ids, top_lps))}
            scored[str(token)] = PromptLogprob(lp, rank, self.text_of(token))
            self.prompt_logprobs.append(scored)

    def _lp(self, index: int, offset: int):
        return self._format_logprobs(self._logprobs[index], offset) if self.spec.logprobs else None

    def _format_logprobs(self, entries: list[tuple[int, tuple]], offset: int):
        text = self.text_of
        if self._chat:
            return ChatLogprobs([
                TokenLogprob(text(tok), lp, list(text(tok).encode()),
                             [TopLogprob(text(t), v, list(text(t).encode())) for t, v in zip(top_ids, top_lps)])
                for tok, (lp, _, top_ids, top_lps) in entries])
        tokens = [text(tok) for tok, _ in entries]
        offsets = np.cumsum([offset] + [len(t) for t in tokens[:-1]]).tolist() if tokens else []
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp for _, (lp, *_) in entries],
            top_logprobs=[{text(t): v for t, v in zip(top_ids, top_lps)} for _, (_, _, top_ids, top_lps) in entries],
            text_offset=offsets,
        )

    def _envelope(self, choices: list, usage: Usage | None = None, first: bool = False,
                  perf: PerfMetrics | None = None, whole: bool = False):
        """A response (whole) or chunk; `first` carries the per-request extras, `perf` the timings."""
        s = self.spec
        extra: dict[str, Any] = {}
        if first:
            extra = dict(prompt_token_ids_b64=s.prompt_token_ids_b64, prompt_token_ids=s.prompt_token_ids)
            if self._chat:
                extra["prompt_logprobs"] = self.prompt_logprobs
        cls: Any
        if self._chat:
            cls, kind = (ChatCompletion, "chat.completion") if whole else (ChatCompletionChunk, "chat.completion.chunk")
        else:
            cls, kind = Completion, "text_completion"
        return cls(id=s.request_id, object=kind, created=s.created, model=s.model, choices=choices, usage=usage,
                   perf_metrics=perf, service_tier="default" if s.service_tier else None, **extra)


def _text(m: Assembly, kind: str) -> str:
    return "".join(item.text for item in m.items if item.kind == kind)


def _message(m: Assembly) -> ResponseMessage:
    """A choice's items as one response message: its text, its reasoning, its calls."""
    calls = [ToolCallOut(id=c.call_id, type="function", function=FunctionCallOut(c.name, c.text))
             for c in m.items if c.kind == "tool_call"]
    content = _text(m, "text")
    return ResponseMessage(content if content or not calls else None, "assistant",
                           reasoning_content=_text(m, "reasoning") or None, tool_calls=calls)


FRAMERS["chat"] = FRAMERS["completions"] = OpenAIFramer
