"""The real-vLLM engine the connector tests drive: kvdiag.instrumentation.vllm_engine (imports vLLM)."""

from kvdiag.instrumentation.vllm_engine import (
    BLOCK_SIZE,
    CONNECTOR,
    HEAD_SIZE,
    PAGE_BYTES,
    PLAIN_CONNECTOR,
    Engine,
    free_port,
    make_kv_cache_config,
    make_vllm_config,
    write_model_dir,
)

__all__ = ["BLOCK_SIZE", "CONNECTOR", "HEAD_SIZE", "PAGE_BYTES", "PLAIN_CONNECTOR", "Engine", "free_port",
           "make_kv_cache_config", "make_vllm_config", "write_model_dir"]
