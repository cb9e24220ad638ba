"""Reasoning sealed for the client to keep (the Responses API's `include: ["reasoning.encrypted_content"]`):
the text encrypted and authenticated (AES-256-GCM) with this server's key, so that a client that stores nothing
(store: false) can send the reasoning back and the model continues from its own, unaltered.

The key is made once, with 0600 permissions, under the state directory (--state-dir): every process of the
server (the ingress workers that check it, the render workers that open blobs, the postproc workers that seal
them) and every restart on that directory use the same one. Servers behind one router share a key instead
(--sealing-key-file, or SLUICE_SEALING_KEY), so that each opens what another sealed. A blob is `v1.` then
URL-safe base64 of the nonce and the ciphertext with its tag.
"""
from __future__ import annotations

import base64
import binascii
import os
import secrets
from functools import lru_cache
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sluice.base import envs

KEY_FILE = "reasoning.key"
_PREFIX = "v1."
_NONCE_BYTES = 12
_CONTEXT = b"sluice reasoning v1"  # (associated data: a blob sealed for another purpose does not open here)


class Unsealable(ValueError):
    """A blob this server did not seal, or one altered since."""


class Sealer:
    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, text: str) -> str:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sealed = nonce + self._aead.encrypt(nonce, text.encode(), _CONTEXT)
        return _PREFIX + base64.urlsafe_b64encode(sealed).decode()

    def open(self, blob: str) -> str:
        if not blob.startswith(_PREFIX):
            raise Unsealable("not a blob of this server's")
        try:
            raw = base64.urlsafe_b64decode(blob[len(_PREFIX):].encode())
            return self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], _CONTEXT).decode()
        except (binascii.Error, ValueError, InvalidTag):
            raise Unsealable("sealed by another key, or altered") from None


@lru_cache(maxsize=4)
def sealer(state_dir: str) -> Sealer:
    """The sealer of the shared key where one is given (--sealing-key-file, SLUICE_SEALING_KEY), else of the key
    under `state_dir`, made there if there is none yet (raises OSError where the directory cannot hold it, or
    the given key is not one)."""
    return Sealer(shared_key() or _key(Path(state_dir)))


def share(key_file: str) -> None:
    """Makes `key_file` the key of this process and of the processes it starts (OSError where it is not one)."""
    os.environ["SLUICE_SEALING_KEY_FILE"] = str(Path(key_file).resolve())
    sealer.cache_clear()
    shared_key()


def shared_key() -> bytes | None:
    """The key given to every server behind a router (OSError where it is not a 256-bit key): SLUICE_SEALING_KEY
    (base64), else the file SLUICE_SEALING_KEY_FILE names (32 bytes, or their base64 on one line)."""
    if (text := envs.sealing_key()) is not None:
        return _checked(_unbase64(text.encode()), "SLUICE_SEALING_KEY")
    if (path := envs.sealing_key_file()) is not None:
        raw = Path(path).read_bytes()
        return _checked(raw if len(raw) == 32 else _unbase64(raw.strip()), path)
    return None


def _unbase64(text: bytes) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return b""


def _checked(key: bytes, where: str) -> bytes:
    if len(key) != 32:
        raise OSError(f"{where} is not a 256-bit key (32 bytes, or their base64)")
    return key


def _key(state_dir: Path) -> bytes:
    path = state_dir / KEY_FILE
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Written whole under a name of its own, then linked in place: of processes that race here, one key wins
    # (a link never replaces a file), and nobody reads a half-written one.
    part = state_dir / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(AESGCM.generate_key(bit_length=256))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(part, path)
        except FileExistsError:
            pass
    finally:
        part.unlink(missing_ok=True)
    return _read(path)


def _read(path: Path) -> bytes:
    key = path.read_bytes()
    if len(key) != 32:
        raise OSError(f"{path} is not a 256-bit key ({len(key)} bytes)")
    return key
