import pytest

MODEL = "builtin:tiny-chat"


@pytest.fixture(scope="session")
def gpt_oss_server():
    """The tiny gpt-oss checkpoint's real weights, served with trtllm-serve's parser aliases (which name
    what gpt-oss serves by default): shared by the modules that need a gpt-oss model that computes."""
    from bench.server import Server

    s = Server("--model", "builtin:tiny-gpt-oss", "--max-model-len", "4096", "--tool-parser", "gpt_oss",
               "--reasoning-parser", "gpt_oss")
    yield s
    assert s.stop() == 0, s.output()
