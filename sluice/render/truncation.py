"""Truncation 'auto' (the Responses API's): a conversation whose prompt does not fit loses its oldest whole
turns, the fewest that make it fit; system and developer messages stay.

Only a render tells whether a prompt fits, and a render costs as much as the conversation is long: one
render per dropped turn made a long conversation cost the square of its length or more (issue 37: a body
far under the size limit held a render worker for hours). Instead each turn's tokens are counted once, from
its text, to guess how many turns must go; renders then check the guess and its neighbour, and search
outward from it (doubling, then halving) only where the guess was off. Which turns are kept is what dropping
them one at a time keeps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import msgspec

from sluice.render.errors import RequestError
from sluice.render.extensions import message_text
from sluice.schemas.openai import ChatCompletionRequest, ChatMessage

T = TypeVar("T")
FIXED_ROLES = ("system", "developer")  # the instructions: they stay whatever goes
# What chat templates commonly add around a message (role markers, delimiters), in tokens, where the
# server's template cannot be measured: the search's first guess only.
MESSAGE_OVERHEAD_TOKENS = 5


def fitting(request, truncate: bool, attempt: Callable[[Any], T], guess: Callable[[Turns], int]) -> T:
    """attempt(request); where its prompt does not fit and `truncate`, attempt(the request without the fewest
    oldest turns that make it fit), searched from guess(its turns) with a few attempts however many go."""
    outcome = _outcome(attempt, request)
    if not truncate or not _too_long(outcome) or len(turns := Turns.of(request)) < 2:
        return _result(outcome)
    outcomes: dict[int, T | RequestError] = {0: outcome}

    def fits(dropped: int) -> bool:  # (another error ends the search: dropping one at a time ends there too)
        outcomes[dropped] = _outcome(attempt, turns.keeping(dropped))
        return not _too_long(outcomes[dropped])

    return _result(outcomes[fewest_dropped(len(turns), guess(turns), fits)])


def _outcome(attempt: Callable[[Any], T], request) -> T | RequestError:
    try:
        return attempt(request)
    except RecursionError:  # past the depth checks: still the request's nesting, not the server's fault
        return RequestError(400, "the request nests too deeply to render")
    except RequestError as e:
        return e


def _too_long(outcome: object) -> bool:
    return isinstance(outcome, RequestError) and outcome.code == "context_length_exceeded"


def _result(outcome: T | RequestError) -> T:
    if isinstance(outcome, RequestError):
        raise outcome
    return outcome


@dataclass(frozen=True)
class Turns:
    """A chat request cut into the turns truncation may drop, oldest first: each begins with a user message
    (the first with the first message that is not an instruction) and runs to the next user message."""

    request: ChatCompletionRequest
    starts: tuple[int, ...]  # the index in request.messages where each turn begins

    @classmethod
    def of(cls, request: ChatCompletionRequest) -> Turns:
        messages = request.messages
        turns = [i for i, m in enumerate(messages) if m.role not in FIXED_ROLES]
        return cls(request, tuple(turns[:1] + [i for i in turns[1:] if messages[i].role == "user"]))

    def __len__(self) -> int:
        return len(self.starts)

    def keeping(self, dropped: int) -> ChatCompletionRequest:
        """The request without its `dropped` oldest turns (its instructions all kept)."""
        if dropped == 0:
            return self.request
        cut = self.starts[dropped]
        kept = [m for i, m in enumerate(self.request.messages) if i >= cut or m.role in FIXED_ROLES]
        return msgspec.structs.replace(self.request, messages=kept)

    def turn(self, k: int) -> list[ChatMessage]:
        """Turn k's messages (instructions among them are no part of it: they stay)."""
        end = self.starts[k + 1] if k + 1 < len(self.starts) else len(self.request.messages)
        return [m for m in self.request.messages[self.starts[k]:end] if m.role not in FIXED_ROLES]

    def fixed(self) -> list[ChatMessage]:
        return [m for m in self.request.messages if m.role in FIXED_ROLES]


def without_oldest_turn(request: ChatCompletionRequest) -> ChatCompletionRequest | None:
    """The request without its oldest turn; None when the last turn is all that is left."""
    turns = Turns.of(request)
    return turns.keeping(1) if len(turns) >= 2 else None


def counted_text(m: ChatMessage) -> str:
    """What of a message a template renders as text: its content, reasoning and tool calls."""
    calls = "".join(c.function.name + c.function.arguments for c in m.tool_calls or [])
    return message_text(m) + (m.reasoning_content or m.reasoning or "") + calls


def message_overhead(size: Callable[[ChatCompletionRequest], int], count: Callable[[str], int]) -> float:
    """The tokens a chat template adds around a message's text, from `size` (a request's prompt length) on a
    small conversation: a guess that steers the search only (renders decide what fits)."""
    def conversation(*texts: str) -> ChatCompletionRequest:
        messages = [ChatMessage(role=("user", "assistant")[i % 2], content=t) for i, t in enumerate(texts)]
        return ChatCompletionRequest(model="", messages=messages)
    try:
        added = size(conversation("one", "two", "three")) - size(conversation("three")) - count("one") - count("two")
    except Exception:  # noqa: BLE001  (a template that refuses the sample: guess without it)
        return MESSAGE_OVERHEAD_TOKENS
    return max(added / 2, 0.0)


def guess_dropped(turns: Turns, room: float, count: Callable[[str], int], overhead: float,
                  max_token_chars: int) -> int:
    """How many oldest turns to drop for the rest to take at most `room` tokens, each message counted as
    `count` tokenizes its text plus `overhead` (what the chat template adds around it). Newest turns first, and
    only until the room is spent: a turn with too many characters for what room is left is not tokenized."""
    left = room - sum(count(counted_text(m)) + overhead for m in turns.fixed())
    if turns.request.tools and turns.request.tool_choice != "none":
        left -= count(msgspec.json.encode(turns.request.tools).decode())
    for k in reversed(range(len(turns))):
        texts = [counted_text(m) for m in turns.turn(k)]
        if sum(map(len, texts)) > max(left, 0) * max_token_chars:  # (each token covers at most that many)
            return k + 1
        left -= sum(count(t) + overhead for t in texts)
        if left < 0:
            return k + 1
    return 0


def fewest_dropped(n: int, guess: int, fits: Callable[[int], bool]) -> int:
    """The fewest of a conversation's `n` turns (n >= 2) to drop, oldest first, for fits(dropped) to hold,
    known not to for 0; n - 1 (the last turn alone) when it never does, fits(n - 1) then having been asked.

    `fits` must be monotonic (dropping more never makes a prompt stop fitting): then this is what dropping
    one turn at a time finds. It asks fits() twice where `guess` is right (the guess, and one turn fewer), and
    O(log n) times where it is off."""
    k = min(max(guess, 1), n - 1)
    if fits(k):
        bad, good, step = 0, k, 1
        while good - step > bad:  # keep more, in growing steps, until a prompt does not fit
            if not fits(good - step):
                bad = good - step
                break
            good, step = good - step, step * 2
    else:
        bad, good, step = k, n - 1, 1
        while bad < n - 1:  # drop more, in growing steps, until a prompt fits
            probe = min(bad + step, n - 1)
            if fits(probe):
                good = probe
                break
            bad, step = probe, step * 2
        else:
            return n - 1
    while good - bad > 1:
        mid = (bad + good) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good
