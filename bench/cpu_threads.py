"""--cpu-threads settings against each other: bench.flag_ab's run of that flag (one server per setting, all up at
once, streaming rounds interleaved at each concurrency).

    python -m bench.cpu_threads [--model FILE] [--settings auto,2,1] [--concurrencies 1,16] [--rounds 4]
                                [--prompts 3] [--output-len 64]
"""
from __future__ import annotations

from bench.flag_ab import main

if __name__ == "__main__":
    main(flag="--cpu-threads", settings="auto,2,1")
