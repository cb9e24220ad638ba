"""The engine process: scheduler, paged KV cache, model runner, sampler."""
