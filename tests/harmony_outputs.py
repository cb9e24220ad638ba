"""gpt-oss outputs in harmony, as token ids, for parser and end-to-end tests."""
from __future__ import annotations

import json

from openai_harmony import Message, Role

from sluice.base.harmony_vocab import harmony_encoding


def harmony_tokens(msgs) -> list[int]:
    """What the model emits after a prompt that ends with `<|start|>assistant`."""
    enc = harmony_encoding()
    tokens = []
    for m in msgs:
        if m[0] == "call":
            msg = (Message.from_role_and_content(Role.ASSISTANT, json.dumps(m[2])).with_channel("commentary")
                   .with_recipient(f"functions.{m[1]}").with_content_type("<|constrain|>json"))
        else:
            msg = Message.from_role_and_content(Role.ASSISTANT, m[1]).with_channel(m[0])
        tokens += enc.render(msg)
    assert tokens and tokens[0] == 200006 and enc.decode(tokens[1:2]) == "assistant"
    tokens = tokens[2:]
    if tokens[-1] == 200007:  # the last message ends the turn: <|call|> after a call, else <|return|>
        tokens[-1] = 200012 if msgs[-1][0] == "call" else 200002
    return tokens
