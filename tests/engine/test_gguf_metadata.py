"""A GGUF file's metadata as a checkpoint directory (sluice/base/gguf_checkpoint.py): Llama 3.1+ rope factors
(rope_freqs) back to the llama3 rope_scaling that gives them, and SentencePiece (`llama`) vocabularies as a
`tokenizers` Tokenizer that encodes as the SentencePiece model itself and transformers' tokenizer of it."""
from __future__ import annotations

import json

import pytest
import torch

from sluice.app.builtin_models import write_llama_family
from sluice.app.gguf_writer import write_gguf
from sluice.base.gguf_checkpoint import gguf_checkpoint, llama3_factors, llama3_scaling
from sluice.engine.rope import inv_freq_and_scale

# (theta, head_dim, factor, low, high, original): Llama 3.1 8B, Llama 3.2 1B, 3B, and a tiny test model's
CASES = [(500000.0, 128, 8.0, 1.0, 4.0, 8192), (500000.0, 64, 32.0, 1.0, 4.0, 8192),
         (500000.0, 128, 32.0, 1.0, 4.0, 8192), (10000.0, 64, 8.0, 1.0, 4.0, 64), (10000.0, 64, 4.0, 2.0, 8.0, 256)]


@pytest.mark.parametrize("case", CASES)
def test_llama3_factors_are_what_the_engines_llama3_rope_divides_by(case):
    theta, dim, factor, low, high, original = case
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
              "original_max_position_embeddings": original}
    plain, _ = inv_freq_and_scale(dim, theta, {"rope_type": "default"}, 4096)
    scaled, _ = inv_freq_and_scale(dim, theta, params, 4096)
    assert torch.allclose(plain / scaled, torch.tensor(llama3_factors(*case), dtype=torch.float64), rtol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_rope_freqs_map_back_to_a_llama3_scaling_that_gives_them(case):
    theta, dim, factor, low, high, original = case
    factors = [float(torch.tensor(f, dtype=torch.float32)) for f in llama3_factors(*case)]  # (as the file holds)
    scaling = llama3_scaling(factors, theta, dim)
    assert scaling is not None and scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    again = llama3_factors(theta, dim, factor, scaling["low_freq_factor"], scaling["high_freq_factor"],
                           scaling["original_max_position_embeddings"])
    assert again == pytest.approx(factors, rel=1e-5)
    if low == 1.0:  # (the original length is fixed only up to the ratio; it is taken where low is 1)
        assert (scaling["original_max_position_embeddings"], scaling["high_freq_factor"]) == (original, high)


def test_rope_freqs_of_no_llama3_form_are_refused_and_all_ones_are_no_scaling():
    assert llama3_scaling([1.0] * 32, 10000.0, 64) is None
    with pytest.raises(ValueError, match="not Llama 3"):
        llama3_scaling([1.0 + i / 10 for i in range(32)], 10000.0, 64)


# -- SentencePiece --------------------------------------------------------------------------------------------

CORPUS = ["Hello world, this is a tiny corpus for a tokenizer.", "The quick brown fox jumps over the lazy dog!",
          "  indented  text\nwith lines\n\nand\ttabs", "numbers 12345 and 67890, café au lait",
          "def f(x):\n    return x * 2  # code"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEXTS = ["Hello world", "hello  world   three spaces", "trailing space ", "new\nlines\n\nand\ttabs",
         "unicode: café, naïve, 日本語, emoji 🎉", "digits 3141592653", "   leading spaces", "\nleading newline",
         "", "▁ a literal metaspace", "The quick brown fox jumps over the lazy dog!",
         # words the corpus does not have whole: their pieces depend on the merges' order
         "thequickbrownfoxjumpsoverthelazydog", "worldly tokenizers retextured indentation", "overcooked coded dogs",
         "Hellofoxtabslinesnumbers"]
CHAT = ["<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b", "<|im_end|> after",
        "x<tool>y <tool> z"]


def _sentencepiece_gguf(root, **train):
    """(the SentencePiece model trained here, its directory, the tokenizer of a GGUF file of it: a tiny Llama
    checkpoint with the model as its tokenizer.model, written by gguf_writer, read back as metadata)"""
    import sentencepiece as spm  # (the test extra's: it trains the reference model)
    import transformers
    from tokenizers import Tokenizer

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_prefix=str(root / "sp"), vocab_size=420, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=True, split_digits=True,
        control_symbols=SPECIALS, user_defined_symbols=["<tool>"], minloglevel=2,
        **{"remove_extra_whitespaces": False, **train})  # (as Llama 2's: BPE, byte fallback, no normalization)
    reference = root / "reference"
    reference.mkdir()
    (reference / "tokenizer.model").write_bytes((root / "sp.model").read_bytes())
    hf = transformers.LlamaTokenizer.from_pretrained(reference)
    checkpoint = write_llama_family(root / "checkpoint", architecture="LlamaForCausalLM", num_shards=1,
                                    tokenizer=hf.backend_tokenizer)
    (checkpoint / "tokenizer.model").write_bytes((root / "sp.model").read_bytes())
    file = write_gguf(checkpoint, root / "model.gguf", {}, default="F32")
    meta = gguf_checkpoint(file, root / "meta")
    assert json.loads((meta / "tokenizer_config.json").read_text())["bos_token"] == "<s>"
    return spm.SentencePieceProcessor(model_file=str(root / "sp.model")), hf, Tokenizer.from_file(
        str(meta / "tokenizer.json"))


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    """(the SentencePiece model, transformers' tokenizer of it, the tokenizer of the GGUF's metadata)"""
    return _sentencepiece_gguf(tmp_path_factory.mktemp("sentencepiece"))


def test_sentencepiece_text_encodes_as_the_sentencepiece_model_itself(sentencepiece_gguf):
    sp, _, ours = sentencepiece_gguf
    bos = sp.bos_id()
    for text in TEXTS:
        want = sp.encode(text)
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert ours.encode(text).ids == [bos, *want], text  # (BOS added, as llama.cpp and transformers do)
        assert ours.decode(want) == sp.decode(want), text
    assert any(sp.id_to_piece(i).startswith("<0x") for t in TEXTS for i in sp.encode(t))  # (byte fallback ran)


def test_sentencepiece_special_tokens_are_whole_and_each_stretch_between_them_encodes_as_sentencepiece(
        sentencepiece_gguf):
    """Control and user-defined tokens are matched whole (SentencePiece itself never matches control tokens in
    text); each stretch of text around them encodes as SentencePiece encodes it alone, a "▁" opening it
    (llama.cpp's rule; SentencePiece alone would put no "▁" after a user-defined piece)."""
    import re

    sp, _, ours = sentencepiece_gguf
    for text in CHAT:
        want = []
        for part in re.split(f"({'|'.join(map(re.escape, [*SPECIALS, '<tool>']))})", text):
            want += [sp.piece_to_id(part)] if part in [*SPECIALS, "<tool>"] else sp.encode(part) if part else []
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert ours.decode(want, skip_special_tokens=False).replace(" ", "") == text.replace(" ", "")


def test_sentencepiece_merges_equal_transformers_tokenizer_of_the_model(sentencepiece_gguf):
    """transformers' tokenizer of the same tokenizer.model (its merges derived from the vocabulary too) on text
    where its Metaspace and SentencePiece's dummy prefix agree (text not opening with a space or "▁")."""
    _, hf, ours = sentencepiece_gguf
    for text in [t for t in TEXTS + CORPUS if t and t[0] not in " ▁"]:
        assert ours.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False), text


def test_sentencepiece_that_squeezes_spaces_encodes_as_the_model(tmp_path):
    """A model trained with remove_extra_whitespaces (SentencePiece's default; Llama's models turn it off)."""
    sp, _, ours = _sentencepiece_gguf(tmp_path, remove_extra_whitespaces=True)
    assert sp.encode("  a   b ") == sp.encode("a b")  # (the model squeezes them)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == sp.encode(text), text


# llama.cpp's vocabulary-only GGUF files and the token ids its tokenizer tests expect of each (models/ in its
# source, or vendor/llama.cpp/models/ in llama-cpp-python's sdist): real Llama 2 (SentencePiece), Phi-3,
# Llama 3 and Qwen2 vocabularies
LLAMA_CPP_VOCABS = ["llama-spm", "phi-3", "llama-bpe", "qwen2"]


@pytest.mark.parametrize("name", LLAMA_CPP_VOCABS)
def test_llama_cpps_vocabulary_files_encode_as_its_tests_expect(name):
    import os
    from pathlib import Path

    from sluice.base.gguf_checkpoint import build_tokenizer, metadata

    folder = os.environ.get("SLUICE_LLAMA_CPP_VOCABS")
    if not folder or not (Path(folder) / f"ggml-vocab-{name}.gguf").is_file():
        pytest.skip("SLUICE_LLAMA_CPP_VOCABS names no folder of llama.cpp's ggml-vocab-*.gguf files (its models/)")
    file = Path(folder) / f"ggml-vocab-{name}.gguf"
    tok = build_tokenizer(metadata(file)[0])
    texts = Path(f"{file}.inp").read_text().split("\n__ggml_vocab_test__\n")
    want = [[int(x) for x in line.split()] for line in Path(f"{file}.out").read_text().split("\n")][:len(texts)]
    assert len(want) == len(texts) > 40
    assert [tok.encode(t, add_special_tokens=False).ids for t in texts] == want
