import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Built-in checkpoints for the whole session go to one temporary cache.
os.environ.setdefault("SLUICE_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"sluice-test-cache-{os.getuid()}"))


@pytest.fixture(scope="session")
def tiny_chat_dir() -> Path:
    from sluice.builtin_models import ensure_builtin

    return ensure_builtin("tiny-chat")
