"""o200k_harmony as a Hugging Face `tokenizers` BPE, built from the tiktoken ranks.

Byte-level BPE with the o200k split pattern; merges are recovered from the
ranks (a token of rank r merges the two pieces that are themselves tokens),
and the harmony special tokens take ids 199998..201087.
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_BASE_TOKENS = 199998
VOCAB_SIZE = 201088


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what ByteLevel pre-tokenization uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def build_tokenizer(vocab_dir: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from sluice.base.harmony_vocab import FILE_NAME, harmony_encoding

    ranks: dict[bytes, int] = {}
    for line in (Path(vocab_dir) / FILE_NAME).read_bytes().splitlines():
        if line:
            encoded, number = line.split()
            ranks[base64.b64decode(encoded)] = int(number)
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    merges = []
    for piece, rank in ranks.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    bpe = models.BPE({text(t): r for t, r in ranks.items()}, [(text(m[3]), text(m[4])) for m in merges],
                     fuse_unk=False, byte_fallback=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    enc = harmony_encoding()
    tok.add_special_tokens([AddedToken(enc.decode([i]), special=True, normalized=False)
                            for i in range(NUM_BASE_TOKENS, VOCAB_SIZE)])
    return tok


def save_tokenizer(vocab_dir: str, path: Path) -> None:
    """build_tokenizer(vocab_dir) saved as `path` (a tokenizer.json). A build takes seconds, so the file is kept
    under the cache directory, keyed by this module, the vocabulary and openai-harmony's version (whose special
    tokens it holds), and copied from there; with no writable cache it is built each time."""
    from sluice.base import envs
    from sluice.base.harmony_vocab import FILE_NAME

    key = hashlib.sha256(Path(__file__).read_bytes() + (Path(vocab_dir) / FILE_NAME).read_bytes()
                         + metadata.version("openai-harmony").encode()).hexdigest()[:16]
    kept = envs.cache_dir() / "tiktoken" / f"o200k_harmony-{key}.json"
    if not kept.exists():
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=kept.parent)
        except OSError:
            build_tokenizer(vocab_dir).save(str(path))
            return
        os.close(fd)
        try:
            build_tokenizer(vocab_dir).save(tmp)
            os.replace(tmp, kept)  # atomic: processes writing at once each install a whole file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    shutil.copyfile(kept, path)
