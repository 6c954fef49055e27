"""Internal: what runs inside a vLLM engine, the instrumented NIXL connector (docs/connector.md).

vLLM loads it by module path (``kv_connector_module_path``); no other kvdiag module imports it.
Importing this package never imports vLLM: only ``connector``, ``worker`` and ``stats`` do, and
``guard`` and ``sink`` are pure Python. P's outcome rule and the block-hash digest it shares with
the emulated engines live in ``kvdiag.schema``.
"""
