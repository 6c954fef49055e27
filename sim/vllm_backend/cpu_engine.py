"""One P or D engine built from vLLM 0.33.0's real parts, driven on CPU (testbed and tests).

Real: vLLM's v1 ``Scheduler``, the connector under test in the SCHEDULER and WORKER roles (so
kvdiag's ``KVDiagNixlConnector`` with NIXL's UCX agent), CPU KV tensors from
``allocate_kv_cache``, the ZMQ side channel. Stood in: the model forward and the sampler
(deterministic token ids). The step loop copies EngineCore and ``KVConnectorModelRunnerMixin``.

The forward stand-in writes, for every scheduled position, a slot that is a function of the
position, its token id and every earlier token id, as a real model's KV is (``fill_slots``):
K = position + 1, V[h0] = token id % 2048, V[h1] = writer tag, V[h2] = layer + 1, V[h3..h11] =
99 bits of a hash chained over the token prefix. KV computed for another prefix, another token or
another position therefore differs in its bytes. With ``writer_tag=0`` on both sides, KV read from
D and KV P computes itself are byte-identical exactly when the token prefixes are equal.

Import this only in a process that may import vLLM (vLLM's CPU platform pins the process to one
core; callers restore the affinity they had).

Usage::

    eng = CpuEngine("P", write_model_dir(tmp / "opt"), tmp, writer_tag=1, extra={"bidirectional_kv_xfer": True})
    eng.add("cmpl-1-0", prompt_ids, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    out = eng.run("cmpl-1-0")          # EngineCoreOutput; out.kv_transfer_params is P's handle
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import random
import socket
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

BLOCK_SIZE = 32          # the CPU attention backend wants a multiple of 32
NUM_LAYERS = 2
NUM_HEADS = 12
HEAD_SIZE = 64
PAGE_BYTES = 2 * BLOCK_SIZE * NUM_HEADS * HEAD_SIZE * 2   # K and V, fp16: 98,304 bytes per layer per block
CONNECTOR = "KVDiagNixlConnector"
# vLLM imports kvdiag's connector by this path inside the engine: the one place kvdiag names the
# instrumentation package, which no kvdiag module imports (docs/design.md, "Imports").
CONNECTOR_MODULE = "kvdiag.instrumentation.connector"
PLAIN_CONNECTOR = "NixlConnector"

_OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "num_attention_heads": NUM_HEADS,
    "num_hidden_layers": NUM_LAYERS, "ffn_dim": 3072, "vocab_size": 50272, "max_position_embeddings": 2048,
    "torch_dtype": "float16", "word_embed_proj_dim": 768, "do_layer_norm_before": True, "pad_token_id": 1,
    "bos_token_id": 2, "eos_token_id": 2,
}


def _ephemeral_low(default: int = 32768) -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a NIXL side channel, below the kernel's ephemeral range.

    vLLM binds the side channel seconds after this probe, once its imports are done. A port from the
    ephemeral range (what binding port 0 returns) may meanwhile become some outgoing connection's
    source port, and the engine then dies in its handshake listener ("Address already in use") without
    ever getting ready; below that range only another explicit bind can take it.
    """
    low = max(1025, min(_ephemeral_low(), 65536) - 1)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 20000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # a crowded range: fall back to the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_model_dir(path: Path) -> Path:
    """A model directory holding only an OPT-125m-shaped config.json (no weights, no tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_OPT_CONFIG))
    return path


def make_vllm_config(model_dir: Path, *, engine_id: str, connector: str = CONNECTOR,
                     extra: dict[str, Any] | None = None, prefix_caching: bool = False,
                     served_model_name: str | None = None, kv_load_failure_policy: str = "fail") -> VllmConfig:
    """A CPU VllmConfig with the NIXL (or kvdiag) connector, kv_both, block size 32."""
    module = CONNECTOR_MODULE if connector == CONNECTOR else None
    kv = KVTransferConfig(kv_connector=connector, kv_role="kv_both", kv_buffer_device="cpu", engine_id=engine_id,
                          kv_connector_module_path=module, kv_connector_extra_config=dict(extra or {}),
                          kv_load_failure_policy=kv_load_failure_policy)
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=2048,
                        seed=0, served_model_name=served_model_name)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=2048,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv,
    )


def make_kv_cache_config(num_blocks: int) -> KVCacheConfig:
    """One full-attention group over two layers, layer-compact (LBNHC) backing allocation."""
    layers = [f"model.decoder.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float16)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * num_blocks * NUM_LAYERS, layers=layers, layer_stride=page * num_blocks,
                           block_stride=page)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


_dist_ready = False


def init_distributed_once(tmp_dir: Path) -> None:
    """vLLM's worker needs a (gloo, world size 1) process group; one per process."""
    global _dist_ready
    if _dist_ready:
        return
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tmp_dir / ('gloo-' + uuid.uuid4().hex)}")
    initialize_model_parallel(1, 1)
    _dist_ready = True


class CpuEngine:
    """A P or D engine: real Scheduler + connector (both roles) + CPU KV cache; fake forward/sampler."""

    def __init__(self, name: str, model_dir: Path, work_dir: Path, *, writer_tag: int, num_blocks: int = 128,
                 extra: dict[str, Any] | None = None, prefix_caching: bool = False, connector: str = CONNECTOR,
                 with_worker: bool = True, engine_id: str | None = None, served_model_name: str | None = None,
                 side_channel_port: int | None = None, kv_load_failure_policy: str = "fail") -> None:
        self.name = name
        self.writer_tag = writer_tag
        self.engine_id = engine_id or f"{name}-{uuid.uuid4()}"
        # The stand-ins touch one block (~100 KB) at a time: an intra-op thread pool only adds a
        # rendezvous per op, which on a busy machine waits for a core (tens of ms per copy).
        torch.set_num_threads(1)
        self.side_channel_port = side_channel_port or free_port()
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        self.vllm_config = make_vllm_config(model_dir, engine_id=self.engine_id, connector=connector, extra=extra,
                                            prefix_caching=prefix_caching, served_model_name=served_model_name,
                                            kv_load_failure_policy=kv_load_failure_policy)
        self.kv_cache_config = make_kv_cache_config(num_blocks)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.vllm_config.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves on CPU
        log_engine_config(self.vllm_config)
        init_none_hash(_hash_fn(self.vllm_config))
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, _hash_fn(self.vllm_config), 0)
        with set_current_vllm_config(self.vllm_config):
            self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                       structured_output_manager=StructuredOutputManager(self.vllm_config),
                                       block_size=BLOCK_SIZE, log_stats=True)
            self.connector = self.scheduler.connector
            self.worker: Any = None
            self.kv_caches: dict[str, torch.Tensor] = {}
            if with_worker:
                self._start_worker(work_dir)
        self.finished: dict[str, Any] = {}
        self.tokens: dict[str, list[int]] = {}
        self.received: dict[str, dict[str, Any]] = {}
        self.stats: list[dict[str, Any]] = []
        # The sampler stand-in: a planned reply per request (else a running counter).
        self.reply_plans: dict[str, list[int]] = {}
        self.on_output: Any = None   # called with each EngineCoreOutput (the API server's hook)
        # called once per step with (SchedulerStats | None, [EngineCoreOutput], timestamp): the stat loggers' feed
        self.on_stats: Any = None
        self._next_token = 1000 + 100 * writer_tag
        self._chains: dict[str, list[bytes]] = {}   # request id -> prefix hash per position (fill_slots)
        # With record_reads, each D->P read vLLM posts: {"local": P's blocks, "remote": D's block ids,
        # "num_tokens": remote_num_tokens} as the scheduler handed them to the worker (before its end-trim).
        self.record_reads = False
        self.read_plans: dict[str, dict[str, Any]] = {}

    def _start_worker(self, work_dir: Path) -> None:
        init_distributed_once(work_dir)
        self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBNHC)
        self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                          self.kv_cache_config)
        self.worker.register_kv_caches(self.kv_caches)
        self.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): self.worker.get_handshake_metadata()})

    # --- requests -----------------------------------------------------------------------------

    def add(self, request_id: str, prompt: list[int], *, max_tokens: int,
            kv_transfer_params: dict[str, Any] | None = None) -> Request:
        """Add a request as the API server would (ignore_eos, deterministic sampler)."""
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        if kv_transfer_params is not None:
            sp.extra_args = {"kv_transfer_params": dict(kv_transfer_params)}
        req = Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=self.block_hasher)
        if kv_transfer_params is not None and req.kv_transfer_params is None:
            req.kv_transfer_params = dict(kv_transfer_params)
        self.scheduler.add_request(req)
        return req

    # --- the step loop ------------------------------------------------------------------------

    def step(self) -> None:
        """One EngineCore step: schedule, connector worker hooks, fake forward, update."""
        so = self.scheduler.schedule()
        if self.record_reads:
            self._note_read_plans(so.kv_connector_metadata)
        kv_out = None
        if self.worker is not None:
            self.worker.bind_connector_metadata(so.kv_connector_metadata)
            self.worker.start_load_kv(None)
            self._fake_forward(so)
            results = self.worker.get_transfer_results(so.finished_req_ids)
            for rid in set(results.finished_recving or ()) - set(results.failed_recving or ()):
                self._note_received(rid)
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                failed_recving=results.failed_recving, invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
                kv_connector_stats=self.worker.get_kv_connector_stats())
            self.worker.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            done_prefill = req.num_computed_tokens + so.num_scheduled_tokens[rid] >= req.num_tokens
            if done_prefill:
                plan = self.reply_plans.get(rid)
                if plan:
                    sampled.append([plan[req.num_output_tokens % len(plan)]])
                else:
                    sampled.append([self._next_token % 50000])
                    self._next_token += 1
            else:
                sampled.append([])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=kv_out)
        outputs = self.scheduler.update_from_output(so, mro)
        if self.on_stats is not None:
            stats = next((eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats is not None), None)
            self.on_stats(stats, [out for eco in outputs.values() for out in eco.outputs], time.monotonic())
        for eco in outputs.values():
            for out in eco.outputs:
                if out.finish_reason is not None:
                    self._chains.pop(out.request_id, None)
                if self.on_output is not None:
                    self.on_output(out)
                    continue
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finished[out.request_id] = out
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.append(eco.scheduler_stats.kv_connector_stats)

    def _note_read_plans(self, meta: Any) -> None:
        for rid, req in (getattr(meta, "reqs_to_recv", None) or {}).items():
            if req.remote is not None and any(req.local_block_ids):
                self.read_plans[rid] = {"local": [list(g) for g in req.local_block_ids],
                                        "remote": [list(g) for g in req.remote.block_ids],
                                        "num_tokens": req.remote.num_tokens}
                if len(self.read_plans) > 4096:
                    del self.read_plans[next(iter(self.read_plans))]

    def _note_received(self, rid: str) -> None:
        """Record the blocks a READ just filled (before any forward touches them)."""
        req = self.scheduler.requests.get(rid)
        if req is None:
            return
        n = req.num_computed_tokens
        blocks = list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])[: -(-n // BLOCK_SIZE)]
        writers: dict[int, int] = {}
        cache = next(iter(self.kv_caches.values()))
        for pos in range(n):
            tag = int(cache[blocks[pos // BLOCK_SIZE]][1, pos % BLOCK_SIZE, HEAD_SIZE].item())
            writers[tag] = writers.get(tag, 0) + 1
        self.received[rid] = {"blocks": blocks, "tokens": n, "bytes": self.block_bytes(blocks), "writers": writers}

    def _fake_forward(self, so: Any) -> None:
        """Write ``fill_slots`` for every scheduled position (the stand-in for the model forward).

        A layer's block view is [H, N, C] with C = K (64) then V (64).
        """
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n  # schedule() already advanced it
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            chain = self._chains.setdefault(rid, [])
            if len(self._chains) > 4096:   # finished requests are dropped in step(); bound the rest
                del self._chains[next(iter(self._chains))]
            rows = fill_slots(req.all_token_ids, start, n, self.writer_tag, chain)
            for layer, cache in enumerate(self.kv_caches.values()):
                rows[:, 2, HEAD_SIZE:] = float(layer + 1)
                pos, end = start, start + n
                while pos < end:
                    slot = pos % BLOCK_SIZE
                    take = min(BLOCK_SIZE - slot, end - pos)
                    cache[block_ids[pos // BLOCK_SIZE]][:, slot:slot + take, :] = \
                        rows[pos - start:pos - start + take].transpose(0, 1)
                    pos += take

    def run(self, request_id: str, max_steps: int = 2000, *, idle_sleep: float = 0.002) -> Any:
        """Step until ``request_id`` finished; return its EngineCoreOutput."""
        for _ in range(max_steps):
            if request_id in self.finished:
                return self.finished[request_id]
            self.step()
            time.sleep(idle_sleep)
        raise TimeoutError(f"{self.name}: {request_id} did not finish in {max_steps} steps")

    def pump(self, steps: int = 5) -> None:
        """Keep stepping (a D holding blocks reaps leases and answers notifications)."""
        for _ in range(steps):
            self.step()

    def position_bytes(self, block_ids: list[int], n: int) -> list[bytes]:
        """The raw bytes of positions ``0..n-1`` held in ``block_ids``: per position, every layer's K and V."""
        caches = list(self.kv_caches.values())
        out: list[bytes] = []
        for i in range(-(-n // BLOCK_SIZE)):
            # [layer, head, slot, channel] -> [slot, layer, head, channel]: one copy per block
            raw = torch.stack([cache[block_ids[i]] for cache in caches]).permute(2, 0, 1, 3).contiguous()
            data = raw.numpy().tobytes()
            size = len(data) // BLOCK_SIZE
            out.extend(data[k * size:(k + 1) * size] for k in range(min(BLOCK_SIZE, n - i * BLOCK_SIZE)))
        return out

    def block_bytes(self, block_ids: list[int]) -> list[bytes]:
        """The raw bytes of each block, all layers (for byte-exact checks)."""
        return [b"".join(cache[b].contiguous().numpy().tobytes() for cache in self.kv_caches.values())
                for b in block_ids]

    def shutdown(self) -> None:
        for part in (self.worker, self.connector):
            if part is not None:
                part.shutdown()


PREFIX_HEADS = range(3, NUM_HEADS)   # V heads carrying the prefix hash, 11 bits each
PREFIX_BITS = range(len(PREFIX_HEADS))


def fill_slots(token_ids: Any, start: int, n: int, writer_tag: int, chain: list[bytes]) -> torch.Tensor:
    """The KV the forward stand-in writes for positions ``start..start+n-1``, as [n, H, 2 * HEAD_SIZE] fp16.

    ``chain`` caches the prefix hash of each position of this request (extended in place): the hash
    at position p covers token ids 0..p, so a slot changes whenever any earlier token does. Every
    value is an integer below 2049, exact in fp16. V[h2] (the layer) is set by the caller.
    """
    while len(chain) < start + n:
        pos = len(chain)
        token = int(token_ids[pos]) if pos < len(token_ids) else 0
        parent = chain[-1] if chain else b""
        chain.append(hashlib.blake2b(parent + token.to_bytes(4, "little"), digest_size=16).digest())
    rows = torch.empty((n, NUM_HEADS, 2 * HEAD_SIZE), dtype=torch.float16)
    values = []
    for pos in range(start, start + n):
        token = int(token_ids[pos]) if pos < len(token_ids) else 0
        h = int.from_bytes(chain[pos], "little")
        values.append([pos + 1, token % 2048, writer_tag, 0, *((h >> (11 * k)) & 2047 for k in PREFIX_BITS)])
    table = torch.tensor(values, dtype=torch.float16)                    # [n, 4 + prefix heads]
    rows[:, :, :HEAD_SIZE] = table[:, 0, None, None]
    rows[:, 0, HEAD_SIZE:] = table[:, 1, None]
    rows[:, 1, HEAD_SIZE:] = table[:, 2, None]
    rows[:, 2, HEAD_SIZE:] = 0.0
    rows[:, PREFIX_HEADS.start:, HEAD_SIZE:] = table[:, 4:, None]
    return rows


def _source_line(module: Any, text: str) -> int:
    """The line of ``module``'s source whose logging call writes ``text`` (the call's first line)."""
    lines = inspect.getsource(module).splitlines()
    at = next(i for i, line in enumerate(lines) if text in line)
    return next(i for i in range(at, -1, -1) if "logger." in lines[i]) + 1


def log_engine_config(vllm_config: VllmConfig) -> None:
    """EngineCore's startup line (``Initializing a V1 LLM engine (v…) with config: …``), as its own file and
    line: vLLM's formatter, the config's own ``__str__``."""
    import vllm.v1.engine.core as core  # noqa: PLC0415 - heavy; only here
    from vllm import __version__  # noqa: PLC0415

    log = logging.getLogger(core.__name__)
    if not log.isEnabledFor(logging.INFO):
        return
    record = log.makeRecord(log.name, logging.INFO, str(core.__file__),
                            _source_line(core, "Initializing a V1 LLM engine (v%s) with config: %s"),
                            "Initializing a V1 LLM engine (v%s) with config: %s", (__version__, vllm_config), None,
                            func="__init__")
    log.handle(record)


def _hash_fn(vllm_config: VllmConfig) -> Any:
    return get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
