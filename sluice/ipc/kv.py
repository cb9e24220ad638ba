"""What crosses engines in disaggregated serving and KV-aware routing: the KV transfer handle (context engine
-> orchestrator -> generation engine), the release that ends a lease, and the prefix cache's block events
(every engine -> the router)."""
from __future__ import annotations

import base64
import hashlib

import msgspec
import numpy as np

from sluice.ipc.messages import Logprobs
from sluice.schemas.openai import DisaggregatedParams

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


def block_hashes(token_ids: list[int], cache_salt: str, block_size: int) -> list[bytes]:
    """The prefix cache's hash of each full block of `token_ids`, as engine/block_manager.py computes them: each
    chained from its parent's (the first from the salt), so equal hashes mean equal prefixes."""
    out: list[bytes] = []
    ids = np.asarray(token_ids, dtype=np.int32)
    for i in range(len(token_ids) // block_size):
        h = hashlib.blake2b(out[-1] if out else cache_salt.encode(), digest_size=16)
        h.update(ids[i * block_size:(i + 1) * block_size].tobytes())
        out.append(h.digest())
    return out


class KvLayout(msgspec.Struct, frozen=True, **_WIRE):
    """How one engine's paged KV cache is laid out: an import needs the same on both sides."""

    block_size: int
    dtype: str  # e.g. "float32"
    pools: tuple[str, ...]  # each layer's pool: "block_table" or "window_table"
    heads: int
    head_dim: int

    @property
    def block_elements(self) -> int:
        """Elements of one block in one K (or V) tensor of one layer."""
        return self.block_size * self.heads * self.head_dim


class KvHandle(msgspec.Struct, **_WIRE):
    """Where a context engine keeps a prompt's KV blocks, under a lease: opaque to the orchestrator (base64)."""

    transfer_id: str
    backend: str  # the transport that reads it ("shm", "mooncake")
    agent: str  # the context engine's control socket: releases go there (tcp://host:port)
    layout: KvLayout | None  # None: a replay engine (no KV data moves; the blocks are only accounted)
    num_prompt_tokens: int
    blocks: list[bytes]  # int32 block ids of each choice's table, in the main pool
    window_blocks: list[bytes] = []  # of each choice, in the sliding-window pool (-1: freed), when it has one
    lease_slot: int = 0  # the lease's slot in the context engine's lease table
    lease_tag: int = 0  # that slot holds this tag while the lease lives (a read checks it before and after)
    seeds: list[int] = []  # each choice's seed: an unseeded choice goes on with the stream it began
    location: dict[str, str] = {}  # transport-specific: files, agent metadata (base64)
    expires: float = 0.0  # wall-clock seconds when the lease ends

    def encode(self) -> str:
        return base64.b64encode(_encoder.encode(self)).decode()

    @classmethod
    def decode(cls, raw: bytes) -> "KvHandle":
        """From the bytes `encode`'s base64 stands for."""
        return _handle_decoder.decode(raw)


class KvRelease(msgspec.Struct, tag=True, **_WIRE):
    """The generation engine has read the blocks (or given up): the context engine may free them."""

    transfer_id: str


class KvEvents(msgspec.Struct, tag=True, **_WIRE):
    """Changes to one engine's prefix cache since its previous message: block hashes (16 bytes each,
    engine/block_manager.py's, salted by cache_salt) stored and removed. `seq` counts messages: a gap means a
    message was lost, and the subscriber asks for a snapshot again."""

    seq: int
    stored: list[bytes] = []
    removed: list[bytes] = []
    snapshot: bool = False  # `stored` is everything cached now: forget what was known before


class ContextState(msgspec.Struct, **_WIRE):
    """What a generation worker needs of a context worker's answer besides the first tokens: TensorRT-LLM's
    opaque_state (its `encoded_opaque_state` on the wire, base64 of this struct's msgpack)."""

    handle: KvHandle
    prompt_token_ids: bytes  # int32: the prompt the context worker rendered (not rendered again)
    output_prefix_len: int = 0  # the prompt's last ids that begin the output (a forced tool call)
    num_cached_tokens: int = 0  # prompt tokens the context worker found in its prefix cache
    prompt_logprobs: Logprobs | None = None  # of prompt positions 1.., where the request asks for prompt_logprobs

    def encode(self) -> str:
        return base64.b64encode(_encoder.encode(self)).decode()

    @classmethod
    def decode(cls, raw: bytes) -> "ContextState":
        """From the bytes `encode`'s base64 stands for (msgspec.MsgspecError when they are not one)."""
        return _state_decoder.decode(raw)


class ContextMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | None = None


class ContextChoice(msgspec.Struct):
    disaggregated_params: DisaggregatedParams
    index: int = 0
    message: ContextMessage | msgspec.UnsetType = msgspec.UNSET  # a chat completion's
    text: str | msgspec.UnsetType = msgspec.UNSET  # a text completion's
    finish_reason: str = "not_finished"  # TensorRT-LLM's orchestrator sends a choice on to a generation worker


class ContextUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class ContextAnswer(msgspec.Struct, kw_only=True):
    """A context worker's whole answer to a context_only request, as TensorRT-LLM's context workers answer (a
    chat.completion or text_completion whose one choice carries disaggregated_params, and the prompt's ids): the
    orchestrator reads it, no client."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ContextChoice]
    usage: ContextUsage
    prompt_token_ids: list[int]
    prompt_token_ids_b64: str | msgspec.UnsetType = msgspec.UNSET


_encoder = msgspec.msgpack.Encoder()
_handle_decoder = msgspec.msgpack.Decoder(KvHandle)
_state_decoder = msgspec.msgpack.Decoder(ContextState)
