"""The real-vLLM engine the connector tests drive: kvdiag.sim.vllm_backend.cpu_engine (imports vLLM)."""

from kvdiag.sim.vllm_backend.cpu_engine import (
    BLOCK_SIZE,
    CONNECTOR,
    HEAD_SIZE,
    PAGE_BYTES,
    PLAIN_CONNECTOR,
    CpuEngine,
    free_port,
    make_kv_cache_config,
    make_vllm_config,
    write_model_dir,
)

__all__ = ["BLOCK_SIZE", "CONNECTOR", "HEAD_SIZE", "PAGE_BYTES", "PLAIN_CONNECTOR", "CpuEngine", "free_port",
           "make_kv_cache_config", "make_vllm_config", "write_model_dir"]
