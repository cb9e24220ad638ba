import pytest

from tests.disagg.helpers import SECRET, Trio


@pytest.fixture(scope="module")
def trio(tiny_chat_dir):
    """A context worker, a generation worker and an aggregated server of the real tiny model."""
    t = Trio(("--kv-lease-timeout", "3"), ())
    yield t
    t.stop()


__all__ = ["SECRET"]
