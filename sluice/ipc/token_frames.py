"""The `generate` endpoint's frames (postproc -> the gRPC door): token ids out, no text.

A frame's data is a run of records, each a 4-byte little-endian length and a msgpack TokenChunk: the
postproc concatenates the chunks of the steps it frames at once, so each one says where it ends."""
from __future__ import annotations

import struct

import msgspec

_LEN = struct.Struct("<I")


class TokenChunk(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Choice `index`'s new token ids (int32), and how it ended when `finish_reason` is set ("stop",
    "length", ...; `stop` the stop string that ended it, if one did)."""

    index: int
    token_ids: bytes
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop: str | None = None
    # per token, with the request's logprobs: (its logprob, the top ids, their logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] = []


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TokenChunk)


def encode_chunk(chunk: TokenChunk) -> bytes:
    payload = _encoder.encode(chunk)
    return _LEN.pack(len(payload)) + payload


def decode_chunks(data: bytes) -> list[TokenChunk]:
    out, pos, view = [], 0, memoryview(data)
    while pos < len(data):
        (size,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        out.append(_decoder.decode(view[pos:pos + size]))
        pos += size
    return out
