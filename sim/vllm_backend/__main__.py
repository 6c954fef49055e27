"""``python -m kvdiag.sim.vllm_backend prefill|decode [options]``: one real-vLLM engine (imports vLLM)."""

import sys

from kvdiag.sim.vllm_backend.api_server import main

sys.exit(main())
