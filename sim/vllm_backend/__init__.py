"""The testbed's real-vLLM engine backend: vLLM 0.33's own Scheduler, kvdiag's connector and NIXL on CPU.

``kvdiag sim prefill|decode --engine vllm`` (or ``python -m kvdiag.sim.vllm_backend``) serves the
emulated engines' OpenAI API over it. Importing this package, ``options`` or ``api_server`` imports
nothing of vLLM: ``cpu_engine`` does, loaded when the step loop starts an engine.
"""
