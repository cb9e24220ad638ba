"""thinking_token_budget (and Anthropic's thinking.budget_tokens, which maps onto it) on a model that reasons in
a <think> block: a grammar lets the reasoning run for at most the budget's tokens, then forces the model's
</think> token (llguidance's max_tokens on a lark rule); after it, the output is free. A model without a
</think> token of its own has no way to end its reasoning: the budget is refused (400)."""
from __future__ import annotations

THINK_PARSERS = ("think", "qwen3", "deepseek_r1")
OPEN, END = "<think>", "</think>"


def refusal(reasoning_parser: str | None, tokens: dict[str, int]) -> str | None:
    """Why a thinking budget cannot be held on this model (None: it can); `tokens`: the vocabulary's own
    tokens for the format's markup."""
    if reasoning_parser not in THINK_PARSERS:
        return ("a thinking budget needs a model that reasons in a <think> block, served with --reasoning-parser "
                f"{', '.join(THINK_PARSERS)}; use max_tokens")
    missing = [t for t in ((OPEN, END) if reasoning_parser != "deepseek_r1" else (END,)) if t not in tokens]
    if missing:
        return (f"this model's vocabulary has no {' nor '.join(missing)} token, so its reasoning cannot be told "
                "apart and ended after a budget; use max_tokens")
    return None


def budget_grammar(budget: int, tokens: dict[str, int], reasoning_from_start: bool) -> str:
    """The lark grammar of an output whose reasoning takes at most `budget` tokens. `reasoning_from_start`: the
    output begins inside the reasoning (the prompt opened the block, or the parser reads all before </think> as
    reasoning); else the model may open it with <think> as its first token, or not reason at all."""
    end = tokens[END]
    think = f"think[max_tokens={budget}]: /(?s:.*)/\nrest: <[*]>*\n"  # (a text regex: no special token inside)
    if reasoning_from_start:
        return f"start: think <[{end}]> rest\n" + think
    opened = tokens[OPEN]
    return f'start: <[{opened}]> think <[{end}]> rest | <[^{opened}]> rest | ""\n' + think
