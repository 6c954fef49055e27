"""Read an engine's scheduler clock through its NIXL side channel, as P does before a D->P read.

D stamps ``remote_blocks_expiry_time`` with its scheduler's ``time.perf_counter()``, a clock that
means nothing on another host. P learns the offset during the NIXL handshake: vLLM's listener
answers a ``(b"get_meta_msg", pp_rank, tp_rank)`` msgpack request on a ZMQ ROUTER socket with two
frames, the handshake payload and ``msgpack(time.perf_counter())``. The emulated engines answer
``POST /nixl/handshake`` with ``{"engine_id", "perf_counter"}``; the port's first bytes tell which
one listens (see :func:`sniff_protocol`). Either way the check gets D's
clock, and with it how long D will still hold a block it just returned: D's real
``decoder_kv_blocks_ttl``. Nothing is registered or changed on the engine.

The ZMQ path needs pyzmq (``pip install 'kvdiag[check]'``); without it the TTL is reported as
"cannot tell".
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import struct
import time
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from kvdiag.schema.errors import KVDiagError

# msgpack of (b"get_meta_msg", 0, 0): fixarray(3), bin8(12) + bytes, fixint 0, fixint 0.
_GET_META: Final = b"\x93\xc4\x0cget_meta_msg\x00\x00"


class SideChannelError(KVDiagError):
    """The side channel did not give a clock reading; the message says why."""


class SideChannelTimeout(SideChannelError):
    """The side channel accepted the connection but did not answer in time."""


@dataclass(frozen=True)
class RemoteClock:
    """``remote perf_counter - local perf_counter`` (at the call's midpoint), with its uncertainty."""

    offset: float
    rtt: float
    protocol: str
    engine_id: str | None = None

    def remote_now(self) -> float:
        """The remote engine's perf_counter now, estimated."""
        return time.perf_counter() + self.offset


def decode_msgpack_float(data: bytes) -> float:
    """The float (or int) a msgpack scalar encodes; raise SideChannelError otherwise."""
    if len(data) == 9 and data[0] == 0xCB:
        return float(struct.unpack(">d", data[1:])[0])
    if len(data) == 5 and data[0] == 0xCA:
        return float(struct.unpack(">f", data[1:])[0])
    if len(data) == 1 and data[0] < 0x80:
        return float(data[0])
    if len(data) == 9 and data[0] == 0xCF:
        return float(struct.unpack(">Q", data[1:])[0])
    raise SideChannelError(f"the clock frame is not a msgpack number ({data[:12].hex()})")


async def _http_clock(session: aiohttp.ClientSession, host: str, port: int, timeout: float) -> RemoteClock:
    url = f"http://{_bracket(host)}:{port}/nixl/handshake"
    start = time.perf_counter()
    try:
        async with session.post(url, json={"engine_id": "kvdiag-check"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body: Any = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        raise SideChannelError(f"no HTTP handshake at {host}:{port} ({type(exc).__name__})") from None
    end = time.perf_counter()
    if not isinstance(body, dict) or not isinstance(body.get("perf_counter"), int | float):
        raise SideChannelError(f"{host}:{port} answered the handshake without a clock")
    engine = body.get("engine_id") if isinstance(body.get("engine_id"), str) else None
    return RemoteClock(float(body["perf_counter"]) - (start + end) / 2, end - start, "http", engine)


def _zmq_clock_blocking(host: str, port: int, timeout: float) -> RemoteClock:
    try:
        zmq: Any = importlib.import_module("zmq")
    except ImportError:
        raise SideChannelError("pyzmq is not installed (pip install 'kvdiag[check]'), so vLLM's ZMQ "
                               "side channel cannot be asked for D's clock") from None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        sock.connect(f"tcp://{_bracket(host)}:{port}")
        start = time.perf_counter()
        sock.send(_GET_META)
        parts = sock.recv_multipart()
        end = time.perf_counter()
    except zmq.Again:
        raise SideChannelTimeout(f"no ZMQ handshake answer from {host}:{port} within {timeout:g} s") from None
    except zmq.ZMQError as exc:
        raise SideChannelError(f"no ZMQ handshake answer from {host}:{port} ({exc})") from None
    finally:
        sock.close(0)
        ctx.term()
    if len(parts) != 2:
        raise SideChannelError(f"{host}:{port} answered with {len(parts)} frames, not vLLM's 2")
    return RemoteClock(decode_msgpack_float(parts[1]) - (start + end) / 2, end - start, "zmq")


async def sniff_protocol(host: str, port: int, wait: float = 0.5) -> str:
    """``"zmq"`` if the port greets first (a ZMTP peer sends its signature on connect), else ``"http"``.

    Nothing is written: bytes a listener does not expect can break it (vLLM's handshake listener
    thread does not survive a message it cannot decode), so the protocol is told from what the
    port says on its own.
    """
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=wait * 4)
    except (OSError, TimeoutError) as exc:
        raise SideChannelError(f"cannot connect to {host}:{port} ({type(exc).__name__}: {exc})") from None
    try:
        first = await asyncio.wait_for(reader.read(1), timeout=wait)
    except TimeoutError:
        return "http"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    if first == b"\xff":
        return "zmq"
    raise SideChannelError(f"{host}:{port} spoke first with {first!r}: neither vLLM's ZMQ nor the sim's HTTP")


ZMQ_ATTEMPTS = 3


async def remote_clock(session: aiohttp.ClientSession, host: str, port: int, timeout: float = 3.0) -> RemoteClock:
    """The engine's scheduler clock via its side channel (vLLM's ZMQ handshake, or the sim's HTTP one)."""
    if await sniff_protocol(host, port) == "zmq":
        # vLLM answers from one listener thread of a busy engine process: a single slow answer is not
        # "unreachable". A fresh REQ socket per attempt (a REQ that timed out cannot send again).
        for _ in range(ZMQ_ATTEMPTS - 1):
            with contextlib.suppress(SideChannelTimeout):
                return await asyncio.to_thread(_zmq_clock_blocking, host, port, timeout)
        return await asyncio.to_thread(_zmq_clock_blocking, host, port, timeout)
    return await _http_clock(session, host, port, timeout)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
