"""Instrumented vLLM NIXL connector (docs/connector.md).

Importing this package never imports vLLM: ``report`` (Contract 4's rule, the digest) and ``guard``
are pure Python; ``connector``, ``worker``, ``stats``, ``vllm_engine`` and ``engine_vllm`` import
vLLM and are loaded only inside a vLLM engine (``kv_connector_module_path``) or the CPU testbed.
"""
