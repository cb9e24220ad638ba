"""bench/perplexity.py's chunking, scoring and parsing (llama-perplexity's output, llama-tokenize's ids, Sluice's
prompt_logprobs), and bench/peer.py's Sluice / peer ratios."""
import json
import math

import pytest

from bench.peer import ratios
from bench.perplexity import chunks, parse_llama_perplexity, parse_token_ids, perplexity, prompt_nll, scored

# llama-perplexity's lines (the figures of a run: SmolLM2-135M-Instruct Q4_1, 4 chunks of 512 tokens)
LLAMA_PERPLEXITY = """\
perplexity: tokenizing the input ..
perplexity: calculating perplexity over 4 chunks, n_ctx=512, batch_size=512, n_seq=1
[1]34.5745,[2]43.8480,[3]44.6294,[4]39.8152,
Final estimate: PPL = 39.8152 +/- 4.35442
"""


def test_chunks_are_whole_windows_with_bos_first_as_llama_perplexity_evaluates_them():
    tokens = list(range(100, 125))  # 25 tokens: 3 whole chunks of 8, the last token left out
    assert chunks(tokens, 8, None, bos=None) == [tokens[0:8], tokens[8:16], tokens[16:24]]
    assert chunks(tokens, 8, 2, bos=1) == [[1, *tokens[1:8]], [1, *tokens[9:16]]]


def test_chunks_refuse_a_text_shorter_than_two_windows():
    with pytest.raises(ValueError, match="at least 16"):
        chunks(list(range(15)), 8, None, bos=None)


def test_the_second_half_of_a_chunk_is_scored_less_its_first_position():
    # llama-perplexity: first = n_ctx / 2; logits from position first on score the tokens after it, n_ctx - first - 1
    assert list(scored(8)) == [5, 6, 7]
    assert len(scored(512)) == 512 - 256 - 1


def test_llama_perplexity_output_gives_the_final_estimate_and_each_chunk():
    out = parse_llama_perplexity(LLAMA_PERPLEXITY)
    assert out == {"ppl": 39.8152, "ppl_error": 4.35442, "running": [34.5745, 43.848, 44.6294, 39.8152]}


def test_llama_perplexity_output_without_a_final_estimate_is_an_error():
    with pytest.raises(ValueError, match="Final estimate"):
        parse_llama_perplexity("perplexity: you need at least 1024 tokens to evaluate perplexity")


def test_llama_tokenize_ids_are_read_from_its_list_line():
    assert parse_token_ids("load: printing all EOG tokens:\n[504, 3458, 314, 260]\n") == [504, 3458, 314, 260]
    with pytest.raises(ValueError):
        parse_token_ids("error: could not load model\n")


def _completion(prompt: list[int], logprobs: list[float]) -> dict:
    """A completion body in the shape Sluice answers `prompt_logprobs: 0` with (a top entry beside the token's)."""
    entries: list = [None]
    for token, lp in zip(prompt[1:], logprobs):
        entries.append({"7": {"logprob": -0.01, "rank": 1, "decoded_token": "x"},
                        str(token): {"logprob": lp, "rank": 2, "decoded_token": "y"}})
    return {"choices": [{"index": 0, "text": "z", "prompt_logprobs": entries}]}


def test_prompt_nll_takes_each_scored_positions_own_token_not_the_top_one():
    prompt = [1, 11, 12, 13, 14, 15, 16, 17]
    body = _completion(prompt, [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0])
    assert prompt_nll(body, prompt, scored(8)) == [5.0, 6.0, 7.0]
    assert perplexity([5.0, 6.0, 7.0]) == pytest.approx(math.exp(6.0))


def test_prompt_nll_refuses_an_answer_that_does_not_score_the_prompt_sent():
    prompt = [1, 11, 12, 13]
    with pytest.raises(ValueError, match="positions"):
        prompt_nll(_completion(prompt[:3], [-1.0, -2.0]), prompt, range(3, 4))
    with pytest.raises(ValueError, match="token 99"):
        prompt_nll(_completion(prompt, [-1.0, -2.0, -3.0]), [1, 11, 12, 99], range(3, 4))


def test_peer_ratios_are_sluice_over_the_peer_at_each_point_averaged_over_rounds():
    def point(server, tok_s, itl, ttft, c=16):
        return {"server": server, "concurrency": c, "temperature": 0.0, "tok_s": tok_s, "itl_p50": itl,
                "ttft_p50": ttft, "errors": 0}

    results = [point("sluice", 300, 40, 100), point("sluice", 100, 60, 300), point("llama.cpp", 100, 100, 100),
               point("llama.cpp", 50, 100, 100, c=64),
               {"server": "sluice", "ttft_len": 2000, "ttft_p50": 900},
               {"server": "llama.cpp", "ttft_len": 2000, "ttft_p50": 1200}]
    assert ratios(results, "llama.cpp") == {"tok_s c16 t0.0": 2.0, "itl_p50 c16 t0.0": 0.5,
                                            "ttft_p50 c16 t0.0": 2.0, "ttft 2000": 0.75}


def test_a_quantized_checkpoint_is_served_by_sluice_at_its_float32_default(tmp_path):
    """bench.peer's `--dtype bfloat16` asks both servers for bfloat16, but Sluice's quantized kernels take float32
    rows: a checkpoint whose config declares quantized weights runs Sluice at its defaults."""
    from bench.peer import quantized

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    assert quantized(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert not quantized(str(tmp_path)) and not quantized(str(tmp_path / "model.gguf"))
