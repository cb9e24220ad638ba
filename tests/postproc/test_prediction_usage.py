"""A postproc shard fed drafted steps: a choice with several tokens in one step, its verdict on the last, and
the usage's prediction counts."""
from __future__ import annotations

import json

import msgspec
import pytest
from tokenizers import Tokenizer

from sluice.ipc.messages import Finished, PostprocSpec, Predicted, Started, StepOutputs, ids_to_bytes
from sluice.postproc.worker import Shard


@pytest.fixture
def shard(tiny_chat_dir):
    return Shard(Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json")))


def start(rid, **spec):
    spec = PostprocSpec(request_id=rid, endpoint="chat", model="m", created=1, reply_to="ipc://r", **spec)
    return Started(rid, msgspec.msgpack.encode(spec), num_prompt_tokens=5, num_cached_tokens=0)


@pytest.mark.parametrize("stream", [False, True])
def test_every_token_of_a_drafted_step_shows_and_the_usage_counts_the_prediction(shard, stream):
    ids = shard.tokenizer.encode("one two three four five", add_special_tokens=False).ids
    first, rest = ids[:1], ids[1:]
    steps = [
        StepOutputs([start("r1", stream=stream, include_usage=True, prediction=True)], ["r1"], ids_to_bytes([0]),
                    ids_to_bytes(first)),
        # the rest in one step (a draft all kept and the token after it), and the verdict on its last token
        StepOutputs([], ["r1"] * len(rest), ids_to_bytes([0] * len(rest)), ids_to_bytes(rest),
                    [Finished("r1", 0, "length")], predicted=[Predicted("r1", 0, len(rest) - 1, 2)]),
    ]
    data = b"".join(f.data for out, _ in (shard.on_steps([s]) for s in steps) for f in out.get("ipc://r", []))
    if stream:
        events = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e and e != "data: [DONE]"]
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        usage = events[-1]["usage"]
    else:
        body = json.loads(data)
        text, usage = body["choices"][0]["message"]["content"], body["usage"]
    assert text == "one two three four five"
    assert usage["completion_tokens"] == len(ids)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0, "accepted_prediction_tokens": len(rest) - 1,
                                                  "rejected_prediction_tokens": 2}
    assert shard.requests == {}


def test_a_request_without_a_prediction_keeps_its_usage_shape(shard):
    out, _ = shard.on_steps([StepOutputs([start("r1")], ["r1"], ids_to_bytes([0]), ids_to_bytes([50]),
                                         [Finished("r1", 0, "length")])])
    assert "completion_tokens_details" not in json.loads(out["ipc://r"][0].data)["usage"]
