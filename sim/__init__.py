"""GPU-free P/D testbed: emulated vLLM prefill and decode engines, and the workload client."""
