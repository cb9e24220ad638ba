"""One request's output state in its postproc shard: an output pipeline per choice."""
from __future__ import annotations

import logging
import time

import msgspec
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from sluice.base import hooks, metrics, tracing
from sluice.ipc.messages import Failure, Frame, PostprocSpec, Started, Timings
from sluice.postproc.framers import framer_for
from sluice.postproc.parsers import Piece, ToolParser, keeps_special_tokens, text_parser
from sluice.postproc.stop import StopStrings
from sluice.schemas.openai import PerfMetrics

log = logging.getLogger("sluice.postproc")


class Choice:
    """Tokens in, message pieces out: detokenize, stop strings, parsers (or harmony on the tokens)."""

    def __init__(self, spec: PostprocSpec, tokenizer: Tokenizer, hook: hooks.PostProcessorHook | None = None,
                 index: int = 0) -> None:
        """`hook`: --post-processor-hook (text output only: the server refuses it with harmony at start)."""
        self.tokenizer = tokenizer
        self.hook, self.request_id, self.index = hook, spec.request_id, index
        self.text = ""  # the text so far as the model wrote it (with a hook)
        self.withheld = False  # the hook withheld the last token's text: its id and logprobs go with it
        self.withheld_at: list[int] = []  # streaming: where such tokens are in pending_ids
        self.stops = StopStrings(spec.stop, spec.include_stop_str_in_output)
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self.last_token_at = 0.0
        self.has_tool_calls = False
        self.reasoning_tokens = 0  # a token that shows no text counts with the text before it
        self._reasoning = False  # the last text shown was reasoning only
        self.pending_logprobs: list = []  # streaming: what the next frame carries
        self.pending_ids: list[int] = []
        self.pending = Piece()  # the pending ids' pieces, merged (while there are pending ids)
        self.frames_sent = 0
        self.harmony = None
        if spec.output_mode == "tokens":
            from sluice.base.harmony_vocab import harmony_encoding
            from sluice.postproc.harmony import HarmonyParser

            self.harmony = HarmonyParser(harmony_encoding(), spec.output_prefix)
            return
        skip = spec.skip_special_tokens and not keeps_special_tokens(spec.parsers)  # (a format's markers stay)
        self.decode = DecodeStream(skip_special_tokens=skip)
        self.parsers = [text_parser(name, spec.parallel_tool_calls, spec.tool_param_types) for name in spec.parsers]
        if spec.output_prefix:  # a forced start already in the prompt: the parsers read it, nobody sees it
            self._parse(Piece(content=tokenizer.decode(spec.output_prefix, skip_special_tokens=False)), False)

    @property
    def _calls_done(self) -> bool:
        return any(isinstance(p, ToolParser) and p.done for p in self.parsers) if self.harmony is None else False

    def on_token(self, token: int, verdict: str | None) -> Piece:
        """Feeds one token with the engine's verdict on it (FinishReason); returns what it adds to the message.
        A finish reason without a verdict means the choice ended here, before the engine ended it (a stop
        string, malformed output, its last allowed tool call)."""
        self.num_tokens += 1
        finish_reason = "stop" if verdict in ("stop_token", "grammar") else verdict
        harmony = self.harmony
        if harmony is not None:
            piece = harmony.feed(token)  # harmony's stop tokens end its messages: it reads them too
            if harmony.failed and finish_reason is None:
                finish_reason = "error"
        else:
            # A stop token is not part of the output.
            piece = Piece(content="" if verdict == "stop_token" else self.decode.step(self.tokenizer, token) or "")
        if self.stops.stops:
            piece.content = self.stops.feed(piece.content)
            if self.stops.stopped:
                finish_reason = "stop"
            elif finish_reason:
                piece.content += self.stops.flush()
        if harmony is None:
            if self.hook is not None:
                finish_reason = self._vetted(piece, token, finish_reason)
            piece = self._parse(piece, finish_reason is not None)
            if finish_reason is None and self._calls_done:
                finish_reason = "stop"
        if piece.tool_calls:
            self.has_tool_calls = True
        if piece.content or piece.tool_calls:  # an empty piece leaves _reasoning as it was
            self._reasoning = False
        elif piece.reasoning:
            self._reasoning = True
        self.reasoning_tokens += self._reasoning
        if finish_reason == "stop" and self.has_tool_calls:
            finish_reason = "tool_calls"
        self.finish_reason = finish_reason
        return piece

    def _vetted(self, piece: Piece, token: int, finish_reason: str | None) -> str | None:
        """Puts the piece's text through the hook (which may change, drop or end it); the finish reason then."""
        assert self.hook is not None
        self.text += piece.content
        verdict = hooks.vetted(self.hook, hooks.OutputChunk(self.request_id, self.index, piece.content, self.text,
                                                            token, finish_reason is not None))
        self.withheld = not isinstance(verdict, hooks.Emit)
        if isinstance(verdict, hooks.Emit):
            piece.content = verdict.text
            return finish_reason
        piece.content = ""
        if isinstance(verdict, hooks.Terminate) and finish_reason is None:
            log.info("--post-processor-hook ended choice %d of %s: %s", self.index, self.request_id, verdict.reason)
            return "stop"
        return finish_reason

    def _parse(self, piece: Piece, final: bool) -> Piece:
        for parser in self.parsers:
            piece = parser.feed(piece, final)
        return piece


class RequestOutput:
    def __init__(self, spec: PostprocSpec, tokenizer: Tokenizer, started: Started, text_of,
                 hook: hooks.PostProcessorHook | None = None) -> None:
        self.spec = spec
        self.started = started
        self.choices = [Choice(spec, tokenizer, hook, i) for i in range(spec.n)]
        self.framer = framer_for(spec, started.num_prompt_tokens, started.num_cached_tokens, text_of)
        # (a stored stream's framer also builds the whole body, which the last frame carries: Frame.stored)
        self._adds = not spec.stream or self.framer.takes_each_piece or spec.store
        # A streamed harmony output with no stop strings nor logprobs: most of its tokens only add text
        # (HarmonyParser.plain_text), which `feed` merges into the pending piece itself.
        self._lean = (spec.stream and not self._adds and not spec.logprobs and self.choices[0].harmony is not None
                      and not self.choices[0].stops.stops)
        # and with a chunk each token, such a run of text is framed by the framer's text_chunk where it has one
        self._text_chunk = self.framer.text_chunk if self._lean and spec.stream_interval == 1 else None
        self.first_token_at = 0.0
        self.timings: list[Timings] = []  # the engine's, one per finished choice
        self.num_finished = 0  # choices with a finish reason

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.choices)

    @property
    def completion_tokens(self) -> int:
        choices = self.choices
        return choices[0].num_tokens if len(choices) == 1 else sum(c.num_tokens for c in choices)

    def predicted(self, accepted: int, rejected: int) -> None:
        """A step verified draft tokens of the request's predicted output: `accepted` kept, `rejected` not."""
        self.framer.accepted_prediction_tokens += accepted
        self.framer.rejected_prediction_tokens += rejected

    def on_token(self, index: int, token: int, finish_reason: str | None, logprobs: tuple | None,
                 gaps: list[float] | None = None) -> bytes:
        """Feeds choice `index` one token; returns the SSE bytes to send now (streaming)."""
        self.feed(index, token, finish_reason, logprobs, gaps)
        return self.chunk(index)

    def feed(self, index: int, token: int, finish_reason: str | None, logprobs: tuple | None,
             gaps: list[float] | None = None, now: float = 0.0) -> str | None:
        """Feeds choice `index` one token: what it adds waits for `chunk`; returns the choice's finish reason
        (None while it goes on). The time since the choice's previous token goes into `gaps` (observed in bulk
        by the caller); `now`: when the token came (the step's arrival: one clock read a step), by default the
        time of this call."""
        choice = self.choices[index]
        if choice.finish_reason is not None:  # a token in flight after the choice ended early
            return choice.finish_reason
        now = now or time.time()
        if not self.first_token_at:
            self.first_token_at = now
            metrics.LATER.observe(metrics.TTFT, now - self.spec.arrival_time)
        elif choice.last_token_at and gaps is not None:
            gaps.append(now - choice.last_token_at)
        choice.last_token_at = now
        if (self._lean and finish_reason is None and (harmony := choice.harmony) is not None
                and (plain := harmony.plain_text(token)) is not None):
            # what on_token and the pending merge below do with such a token's piece
            text, reasoning = plain
            choice.num_tokens += 1
            choice._reasoning = reasoning
            choice.reasoning_tokens += reasoning
            if not choice.pending_ids:
                choice.pending = Piece(reasoning=text) if reasoning else Piece(content=text)
            elif reasoning:
                choice.pending.reasoning += text
            else:
                choice.pending.content += text
            choice.pending_ids.append(token)
            return None
        piece = choice.on_token(token, finish_reason)
        finish = choice.finish_reason
        if finish is not None:
            self.num_finished += 1
            if choice.stops.matched is not None:
                self.framer.stopped_by(index, choice.stops.matched)
        shown = not choice.withheld  # (a token whose text the hook withheld shows neither its id nor its logprobs)
        entries = [(token, logprobs)] if logprobs is not None and self.spec.logprobs and shown else []
        if self._adds:
            self.framer.add(index, piece, entries, [token] if shown else [], finish)
        if self.spec.stream:
            if entries:
                choice.pending_logprobs += entries
            if choice.pending_ids:
                choice.pending.extend(piece)
            else:  # the first since the last frame: it is the merge (nobody else holds it)
                choice.pending = piece
            if not shown:
                choice.withheld_at.append(len(choice.pending_ids))
            choice.pending_ids.append(token)
        return finish

    def chunk(self, index: int) -> bytes:
        """The SSE bytes choice `index` sends now (streaming): everything fed since its last chunk, in one
        chunk, once `stream_interval` tokens are waiting (the first token at once, the last whatever the
        count)."""
        choice = self.choices[index]
        if not self.spec.stream or not choice.pending_ids:
            return b""
        if (self._text_chunk is not None and choice.frames_sent and not choice.finish_reason
                and (out := self._text_chunk(index, choice.pending)) is not None):
            choice.frames_sent += 1  # (what the way below does with such a piece, in fewer steps)
            choice.pending_ids = []
            return out
        interval = 1 if choice.frames_sent == 0 else self.spec.stream_interval
        if not choice.finish_reason and (not choice.pending or len(choice.pending_ids) < interval):
            if choice.frames_sent:
                return b""
            return self.framer.chunk(index, Piece(), None, [], [], self.completion_tokens)
        choice.frames_sent += 1
        entries, choice.pending_logprobs = choice.pending_logprobs, []
        ids, choice.pending_ids = choice.pending_ids, []
        if choice.withheld_at:  # (pending_ids counts every token fed; the frame shows those not withheld)
            withheld, choice.withheld_at = set(choice.withheld_at), []
            ids = [t for i, t in enumerate(ids) if i not in withheld]
        return self.framer.chunk(index, choice.pending, choice.finish_reason, entries, ids, self.completion_tokens)

    def final(self, before: bytes = b"") -> Frame:
        """The last frame: `before` (chunks not yet sent), then the stream's tail or the whole body."""
        perf = self.perf() if self.spec.perf_metrics else None
        self.framer.reasoning_tokens = sum(c.reasoning_tokens for c in self.choices)
        if not self.spec.stream:
            return self.frame(before + self.framer.body(self.completion_tokens, perf), True)
        tail = self.framer.end(self.completion_tokens, perf)
        stored = self.framer.body(self.completion_tokens, perf) if self.spec.store else b""
        return self.frame(before + tail, True, stored=stored)

    def frame(self, data: bytes, done: bool = False, error: Failure | None = None, stored: bytes = b"") -> Frame:
        """A frame of this request: `data`, all the framer wrote since the last frame, numbered and sized by it."""
        return Frame(self.spec.request_id, data, done, error, stored, self.framer.sequence_number,
                     self.framer.take_sizes())

    def perf(self) -> PerfMetrics:
        t = self.timings or [Timings(self.spec.request_id, 0, self.spec.arrival_time, 0.0, 0.0, 0.0, 0.0)]
        return PerfMetrics(arrival_time=self.spec.arrival_time,
                           render_done_time=min(x.render_done for x in t),
                           first_scheduled_time=min(x.first_scheduled for x in t),
                           first_token_time=min(x.first_token for x in t),
                           last_token_time=max(x.last_token for x in t),
                           num_cached_tokens=self.started.num_cached_tokens)

    def summary(self) -> dict:
        """The request's line in the logs and in --kv-timing-output."""
        perf = self.perf()
        done = time.time()
        return {"request_id": self.spec.request_id, "endpoint": self.spec.endpoint, "status": 200,
                **({"user": self.spec.user} if self.spec.user is not None else {}),
                **tracing.fields(self.spec.trace),
                "finish_reasons": [c.finish_reason for c in self.choices],
                "prompt_tokens": self.started.num_prompt_tokens, "cached_tokens": self.started.num_cached_tokens,
                "completion_tokens": self.completion_tokens,
                "ttft_ms": round((self.first_token_at - self.spec.arrival_time) * 1000, 3),
                "e2e_ms": round((done - self.spec.arrival_time) * 1000, 3),
                **msgspec.structs.asdict(perf)}
