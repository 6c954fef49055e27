"""Instrumented vLLM connector (imports vLLM only in its own module, never from here)."""
