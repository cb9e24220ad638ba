"""Sealed reasoning (sluice/sealing.py): what is sealed opens to the same text, nothing altered or sealed by
another key opens, and every process on one state directory (racing to make the key, or started later) seals
and opens with the same key."""
from __future__ import annotations

import base64
import multiprocessing
import stat

import pytest

from sluice.base import sealing

TEXT = "I should call the tool first. ünïcode ✓"


@pytest.fixture(autouse=True)
def _no_cached_keys():
    sealing.sealer.cache_clear()  # (each test's processes start afresh, as a restarted server does)
    yield
    sealing.sealer.cache_clear()


def test_what_is_sealed_opens_to_the_same_text_and_no_two_seals_look_alike(tmp_path):
    s = sealing.sealer(str(tmp_path))
    a, b = s.seal(TEXT), s.seal(TEXT)
    assert a != b and TEXT not in a and s.open(a) == s.open(b) == TEXT
    assert s.open(s.seal("")) == ""


def test_the_key_is_made_once_readable_by_its_owner_alone(tmp_path):
    state = tmp_path / "state"  # (made with the key, as the database makes it)
    blob = sealing.sealer(str(state)).seal(TEXT)
    key = state / sealing.KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    assert [p.name for p in state.iterdir()] == [sealing.KEY_FILE]  # (no part file left behind)
    sealing.sealer.cache_clear()
    assert sealing.sealer(str(state)).open(blob) == TEXT  # a restart reads the same key


def _flip(blob: str, at: int) -> str:
    raw = bytearray(base64.urlsafe_b64decode(blob[3:]))
    raw[at] ^= 1
    return "v1." + base64.urlsafe_b64encode(bytes(raw)).decode()


@pytest.mark.parametrize("alter", [
    lambda b: _flip(b, 0),  # the nonce
    lambda b: _flip(b, 20),  # the ciphertext
    lambda b: _flip(b, -1),  # the tag
    lambda b: b[:-8],  # cut short
    lambda b: b[3:],  # no version
    lambda b: "v1.not base64!",
    lambda b: "v1.",
])
def test_an_altered_blob_does_not_open(tmp_path, alter):
    s = sealing.sealer(str(tmp_path))
    with pytest.raises(sealing.Unsealable):
        s.open(alter(s.seal(TEXT)))


def test_a_blob_sealed_by_another_server_does_not_open(tmp_path):
    foreign = sealing.sealer(str(tmp_path / "a")).seal(TEXT)
    with pytest.raises(sealing.Unsealable, match="another key"):
        sealing.sealer(str(tmp_path / "b")).open(foreign)


def test_a_key_that_is_not_one_is_an_error_not_a_new_key(tmp_path):
    (tmp_path / sealing.KEY_FILE).write_bytes(b"short")
    with pytest.raises(OSError, match="not a 256-bit key"):
        sealing.sealer(str(tmp_path))


def _seal_in_a_process(state_dir: str, text: str) -> str:
    return sealing.sealer(state_dir).seal(text)


def test_processes_that_race_to_make_the_key_all_seal_with_the_one_that_won(tmp_path):
    state_dir = str(tmp_path / "state")
    with multiprocessing.get_context("fork").Pool(6) as pool:
        blobs = pool.starmap(_seal_in_a_process, [(state_dir, f"{TEXT} {i}") for i in range(12)])
    opener = sealing.sealer(state_dir)  # (this process read the key only now)
    assert [opener.open(b) for b in blobs] == [f"{TEXT} {i}" for i in range(12)]
    assert [p.name for p in (tmp_path / "state").iterdir()] == [sealing.KEY_FILE]


def test_a_shared_key_seals_and_opens_on_every_server_that_holds_it(tmp_path, monkeypatch):
    key = b"k" * 32
    (tmp_path / "raw.key").write_bytes(key)
    (tmp_path / "b64.key").write_text(base64.b64encode(key).decode() + "\n")
    blob = sealing.Sealer(key).seal(TEXT)
    for name in ("raw.key", "b64.key"):
        monkeypatch.setenv("SLUICE_SEALING_KEY_FILE", str(tmp_path / name))
        sealing.sealer.cache_clear()
        assert sealing.sealer(str(tmp_path / f"state-{name}")).open(blob) == TEXT
        assert not (tmp_path / f"state-{name}").exists()  # (no key of its own made)
    monkeypatch.delenv("SLUICE_SEALING_KEY_FILE")
    monkeypatch.setenv("SLUICE_SEALING_KEY", base64.b64encode(key).decode())
    sealing.sealer.cache_clear()
    assert sealing.sealer(str(tmp_path / "state")).open(blob) == TEXT
    monkeypatch.delenv("SLUICE_SEALING_KEY")
    sealing.sealer.cache_clear()
    with pytest.raises(sealing.Unsealable):  # (a server with a key of its own)
        sealing.sealer(str(tmp_path / "state")).open(blob)


@pytest.mark.parametrize("content", [b"short", b"k" * 31, base64.b64encode(b"k" * 16), b"not base64 at all!"])
def test_a_shared_key_that_is_not_256_bits_is_refused(tmp_path, monkeypatch, content):
    (tmp_path / "bad.key").write_bytes(content)
    with pytest.raises(OSError, match="not a 256-bit key"):
        sealing.share(str(tmp_path / "bad.key"))
    monkeypatch.delenv("SLUICE_SEALING_KEY_FILE")
