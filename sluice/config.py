"""The server's configuration: one frozen Struct, validated once at startup and
handed to every process (as a JSON file for the granian-started ingress)."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec

from ipc.addresses import Addresses


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str  # as given on the command line: the served model id
    model_path: str  # resolved local checkpoint directory
    served_model_names: list[str]
    runtime_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    ingress_workers: int = 1
    render_workers: int = 1
    postproc_workers: int = 1
    max_model_len: int = 0  # 0: the checkpoint's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int = 0  # 0: derived from kv_cache_memory
    kv_cache_memory: int = 0  # bytes; 0: 1 GiB on CPU, 85% of free memory on CUDA
    runner: str = "model"  # "model" | "replay"
    replay_file: str | None = None
    replay_step_ms: float = 0.0
    dtype: str = "auto"
    device: str = "auto"
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    harmony: bool = True
    trust_request_chat_template: bool = False
    shm_threshold: int = 1 << 20
    shutdown_timeout: float = 30.0
    api_keys: list[str] = []
    protect_metrics: bool = False
    max_request_bytes: int = 32 << 20
    request_timeout: float = 0.0  # seconds; 0: none
    max_pending: int = 4096  # requests in flight across the ingress workers before new ones get 503
    stall_timeout: float = 2.0  # an engine silent for this long is reported stuck
    perf_metrics: bool = False
    stream_interval: int = 1
    coalesce_frames: bool = True  # a request's tokens from steps queued at the postproc go in one event
    kv_timing_output: str | None = None
    log_format: str = "text"  # "text" | "json"

    @property
    def addresses(self) -> Addresses:
        return Addresses(self.runtime_dir)

    def bulk(self) -> dict:
        """Channel options for sockets that carry bulk payloads through shared memory."""
        return {"shm_dir": self.addresses.shm_dir, "shm_threshold": self.shm_threshold}

    def hf_config(self) -> dict:
        return json.loads((Path(self.model_path) / "config.json").read_text())

    def dump(self, path: Path) -> None:
        path.write_bytes(msgspec.json.encode(self))

    @classmethod
    def load(cls, path: str) -> "ServerConfig":
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1e9' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().removesuffix("b").removesuffix("i")
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(float(s))
