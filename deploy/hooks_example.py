"""Example hooks for `sluice serve --request-hook` and `--post-processor-hook` (sluice/base/hooks.py):

    sluice serve MODEL --request-hook deploy/hooks_example.py:cap_sampling \\
                       --post-processor-hook deploy/hooks_example.py:BannedPhraseGuard

cap_sampling runs in the render workers on each rendered request, before the engine; BannedPhraseGuard runs in
the postproc workers on each choice's new text, before the reasoning and tool-call parsers. Copy this file and
change it: it is loaded by path, so it need not be installed.
"""
from __future__ import annotations

from sluice.base.hooks import OutputChunk, Refused, RenderedRequest, emit, terminate

MAX_TEMPERATURE = 1.5
MAX_PROMPT_TOKENS = 1000
TRIAL_USERS = {"trial"}  # the request's `user` (OpenAI) or metadata.user_id (Anthropic)
TRIAL_MAX_TOKENS = 4


def cap_sampling(request: RenderedRequest) -> dict | None:
    """Refuses a prompt longer than MAX_PROMPT_TOKENS or a temperature above MAX_TEMPERATURE (a 400 in the
    request's dialect), and gives a trial user's request at most TRIAL_MAX_TOKENS tokens; leaves every other
    request as it is."""
    if len(request.prompt_token_ids) > MAX_PROMPT_TOKENS:
        raise Refused(f"a prompt of {len(request.prompt_token_ids)} tokens is longer than this server takes "
                      f"({MAX_PROMPT_TOKENS})")
    if request.sampling.temperature > MAX_TEMPERATURE:
        raise Refused(f"temperature {request.sampling.temperature:g} is above this server's limit of "
                      f"{MAX_TEMPERATURE:g}")
    if request.user in TRIAL_USERS and request.sampling.max_tokens > TRIAL_MAX_TOKENS:
        return {"max_tokens": TRIAL_MAX_TOKENS, "min_tokens": min(request.sampling.min_tokens, TRIAL_MAX_TOKENS)}
    return None


class BannedPhraseGuard:
    """Ends a choice once its text holds a banned phrase, without the chunk that completed it (what came before
    has gone out). One instance per postproc worker; its state is per choice and dropped at the choice's end."""

    BANNED = ("swordfish",)

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], str] = {}

    def __call__(self, chunk: OutputChunk):
        key = (chunk.request_id, chunk.index)
        text = (self.seen.pop(key, "") + chunk.text_diff).lower()
        if any(phrase in text for phrase in self.BANNED):
            return terminate("banned phrase")
        if not chunk.is_final:
            self.seen[key] = text[-64:]  # (enough to find a phrase split across chunks)
        return emit(chunk.text_diff)


def upper_case(chunk: OutputChunk):
    """Every chunk's text in capitals (a hook may be a plain function too)."""
    return emit(chunk.text_diff.upper())
