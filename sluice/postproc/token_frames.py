"""The `generate` endpoint's framer: each choice's token ids as they come, for a front door whose client
detokenizes itself (the gRPC door, sluice/ingress/grpc). Stop strings still end the output here."""
from __future__ import annotations

import numpy as np

from sluice.ipc.messages import PostprocSpec
from sluice.ipc.token_frames import TokenChunk, encode_chunk
from sluice.postproc.framers import FRAMERS, Framer, TokenText
from sluice.postproc.parsers import Piece
from sluice.schemas.openai import PerfMetrics


class TokenFramer(Framer):
    """Streaming only (the door always asks for a stream; it gathers a whole output itself)."""

    def __init__(self, spec: PostprocSpec, num_prompt_tokens: int, num_cached_tokens: int, text_of: TokenText) -> None:
        self.spec = spec
        self.num_prompt_tokens, self.num_cached_tokens = num_prompt_tokens, num_cached_tokens
        self._stops: dict[int, str] = {}

    def chunk(self, index: int, piece: Piece, finish_reason: str | None, logprobs: list[tuple[int, tuple]],
              token_ids: list[int], completion_tokens: int = 0) -> bytes:
        if not token_ids and finish_reason is None:
            return b""
        return encode_chunk(TokenChunk(
            index, np.asarray(token_ids, dtype="<i4").tobytes(), self.num_prompt_tokens, self.num_cached_tokens,
            finish_reason, self._stops.get(index) if finish_reason else None,
            [(lp[0], lp[2], lp[3]) for _, lp in logprobs]))

    def end(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        return b""

    def stopped_by(self, index: int, stop: str) -> None:
        self._stops[index] = stop


FRAMERS["generate"] = TokenFramer
