"""Chat's `prediction` (Predicted Outputs) through the OpenAI SDK against the real server: the output is the
output without it, and the usage counts the draft tokens accepted and rejected."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import MODEL

ASK = [{"role": "user", "content": "Rewrite this sentence about the river and the sea, please."}]


def test_a_prediction_changes_no_token_and_its_tokens_are_counted(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0, extra_body={"ignore_eos": True,
                                                                                     "return_token_ids": True})
    plain = client.chat.completions.create(**kw)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens == 40 and getattr(plain.usage, "completion_tokens_details", None) is None
    own = client.chat.completions.create(prediction={"type": "content", "content": text}, **kw)
    assert own.choices[0].message.content == text
    assert own.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    details = own.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0  # (its text's tokens as the output holds them, mostly)
    half = text[: len(text) // 2] + " and then something else entirely, which the model never says"
    parts = [{"type": "text", "text": half[:10]}, {"type": "text", "text": half[10:]}]
    chunks = list(client.chat.completions.create(prediction={"type": "content", "content": parts}, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    details = chunks[-1].usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0


def test_a_prediction_that_is_not_content_is_a_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       prediction={"type": "audio", "content": "x"})  # type: ignore[arg-type]
