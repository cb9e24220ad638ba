"""Predicted outputs (OpenAI's `prediction`): the client's guess at the output, as a speculative draft.

While a sequence decodes, each step proposes the prediction's next tokens after its last one; the model runs
them in the same forward pass, samples every position with the request's own sampling, and the sequence keeps
the run of positions whose sampled token is the draft's, then the one token sampled after it. A kept token is
always one the model sampled itself at its own output position (each position draws its own seeded uniform),
so the output is the output without a prediction: greedy or seeded, token for token. After a token the
prediction did not have, the draft goes on from where the last tokens appear in it (the output may insert,
drop or change text and come back to the prediction).
"""
from __future__ import annotations

from sluice.ipc.messages import SamplingParams

# Re-aligning: the output's last tokens (up to _MATCH_MAX) are matched into the prediction. One token is enough
# just ahead of where the draft was (within _NEAR: a changed or inserted word); further ahead it takes two, and
# behind it three (a prediction that repeats itself), so a prediction with nothing in common with the output
# seldom drafts (each wrong draft costs its rows of the step).
_MATCH_MAX = 8
_NEAR = 8
_AHEAD_MIN = 2
_BACKWARD_MIN = 3
_SPAN_MAX = 1 << 16


def can_draft(sampling: SamplingParams) -> bool:
    """Whether a request's sampling reads nothing that a drafted position would see differently: penalties
    and bad words read the output before each position (min_tokens is checked per step, grammars by the
    engine)."""
    return not (sampling.needs_penalties or sampling.bad_words_ids)


class Prediction:
    """A choice's prediction: its token ids, and where in them its next output token is expected."""

    __slots__ = ("ids", "pos", "aligned", "span", "_where", "accepted", "rejected")

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.pos = 0  # where the next output token is expected, while aligned; the last place it was, else
        self.aligned = True
        # the most tokens the next draft takes: one past the run the last draft kept when it missed, twice as
        # many when it kept all (a prediction the output keeps leaving costs a row or two a step, not a draft's)
        self.span = _SPAN_MAX
        self._where: dict[int, list[int]] | None = None  # token -> its positions in ids (built when first needed)
        self.accepted = 0  # draft tokens the output kept
        self.rejected = 0  # draft tokens run and not kept

    def draft(self, k: int) -> list[int]:
        """Up to k tokens the output is predicted to go on with."""
        k = min(k, self.span)
        return self.ids[self.pos : self.pos + k] if self.aligned and k > 0 else []

    def verified(self, accepted: int, drafted: int) -> None:
        """A step kept `accepted` tokens of a `drafted`-token draft."""
        self.accepted += accepted
        self.rejected += drafted - accepted
        self.span = min(_SPAN_MAX, 2 * self.span) if accepted == drafted else accepted + 1

    def advance(self, token_ids: list[int], start: int, emitted: int) -> None:
        """Follows the `emitted` tokens just appended to `token_ids` (whose output begins at `start`)."""
        end = len(token_ids)
        if self.aligned and self.ids[self.pos : self.pos + emitted] == token_ids[end - emitted :]:
            self.pos += emitted
            return
        self._realign(token_ids, start)

    def _realign(self, token_ids: list[int], start: int) -> None:
        """Continues after the place in the prediction where the output's last tokens match most of it,
        preferring places ahead of where it was, then the nearest."""
        if self._where is None:
            self._where = {}
            for i, t in enumerate(self.ids):
                self._where.setdefault(t, []).append(i)
        best: tuple[int, bool, int] | None = None
        end = len(token_ids)
        for i in self._where.get(token_ids[-1], ()):
            m = 1
            while m < _MATCH_MAX and i - m >= 0 and end - 1 - m >= start and self.ids[i - m] == token_ids[end - 1 - m]:
                m += 1
            ahead = i + 1 >= self.pos
            if m < (_BACKWARD_MIN if not ahead else 1 if i + 1 - self.pos <= _NEAR else _AHEAD_MIN):
                continue
            key = (m, ahead, -abs(i + 1 - self.pos))
            if best is None or key > best:
                best = key
                where = i + 1
        if best is None:
            self.aligned = False
        else:
            self.aligned, self.pos = True, where


def verified(sampled: list[int], draft: list[int], stop_token_ids: tuple[int, ...]) -> list[int]:
    """The tokens a drafted step keeps: `sampled` holds the token sampled after the last token and after each
    draft token (len(draft) + 1); it keeps them while each is the draft's, up to and with the first that is
    not (or the last, or a stop token: nothing follows it)."""
    for j, token in enumerate(sampled):
        if j == len(draft) or token != draft[j] or token in stop_token_ids:
            return sampled[: j + 1]
    return sampled


def num_accepted(kept: list[int], draft: list[int]) -> int:
    """How many of the kept tokens are the draft's (the run they start with)."""
    n = 0
    while n < len(kept) and n < len(draft) and kept[n] == draft[n]:
        n += 1
    return n
