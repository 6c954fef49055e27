"""An emulated xPyD fleet: several prefill and decode engines in one process (``kvdiag sim fleet``).

Every engine is a full emulated vLLM engine (kvdiag.sim.server) with its own OpenAI port, NIXL
side channel, block pool and prefix cache, so a router in front of the fleet sees what it would
see in front of x Ps and y Ds: a P that served a conversation before holds its prompt in its
prefix cache, a D that decoded the last turn still holds the conversation's sequence (its local
hit shrinks the P->D pull to the tokens it lacks), and the time model prices every prefill and
transfer. The engines share one seed (a P's first token must be the one D then generates).

Usage::

    fleet = await start_fleet(EngineConfig(role="prefill", time_scale=1.0), EngineConfig(role="decode"),
                              FleetSpec(prefill=4, decode=4))
    args = fleet.router_args()   # --prefiller-hosts ... --decoder-ports ... for kvdiag router
    ...
    await fleet.close()
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from kvdiag.schema.process import wait_for_stop_signal, write_ready_file
from kvdiag.sim.config import EngineConfig, EngineConfigError
from kvdiag.sim.server import EngineHandle, start_engine

MAX_ENGINES: Final = 64  # per role: a fleet in one process stays a testbed


@dataclass(frozen=True)
class FleetSpec:
    """How many engines of each role, and where their logs and events go."""

    prefill: int = 4
    decode: int = 4
    log_dir: Path | None = None     # <role>-<i>.log per engine
    events_dir: Path | None = None  # <role>-<i>-events.jsonl per engine (instrumented mode)

    def validate(self) -> None:
        """Raise EngineConfigError naming the option."""
        for name, n in (("--prefill", self.prefill), ("--decode", self.decode)):
            if not 1 <= n <= MAX_ENGINES:
                raise EngineConfigError(f"{name} {n}: a fleet runs 1..{MAX_ENGINES} engines per role")


@dataclass
class Fleet:
    """The running engines, P first."""

    prefill: list[EngineHandle] = field(default_factory=list)
    decode: list[EngineHandle] = field(default_factory=list)

    @property
    def engines(self) -> list[EngineHandle]:
        """Every engine, P then D."""
        return [*self.prefill, *self.decode]

    def describe(self) -> dict[str, Any]:
        """The ready-file contents: per role, each engine's ports and engine id."""
        def one(h: EngineHandle) -> dict[str, Any]:
            return {"url": h.url, "host": h.engine.config.host, "port": h.port,
                    "side_channel_port": h.side_channel_port, "engine_id": h.engine_id}
        return {"prefill": [one(h) for h in self.prefill], "decode": [one(h) for h in self.decode],
                "router_args": self.router_args()}

    def router_args(self) -> list[str]:
        """``kvdiag router`` options that put every engine of the fleet behind the router."""
        def hosts(group: list[EngineHandle]) -> list[str]:
            return [h.engine.config.host for h in group]
        return ["--prefiller-hosts", *hosts(self.prefill), "--prefiller-ports", *(str(h.port) for h in self.prefill),
                "--decoder-hosts", *hosts(self.decode), "--decoder-ports", *(str(h.port) for h in self.decode)]

    async def close(self) -> None:
        """Stop every engine."""
        await asyncio.gather(*(h.close() for h in self.engines), return_exceptions=True)
        self.prefill.clear()
        self.decode.clear()


def engine_config(template: EngineConfig, spec: FleetSpec, index: int) -> EngineConfig:
    """Engine ``index`` of the template's role: free ports, its own engine id, log and event files."""
    role = template.role
    log = str(spec.log_dir / f"{role}-{index}.log") if spec.log_dir is not None else None
    events = (str(spec.events_dir / f"{role}-{index}-events.jsonl")
              if spec.events_dir is not None and template.instrumented else None)
    return replace(template, port=0, side_channel_port=0, engine_id=None, log_file=log, events_file=events)


async def start_fleet(prefill: EngineConfig, decode: EngineConfig, spec: FleetSpec) -> Fleet:
    """Start ``spec.prefill`` engines from the prefill template and ``spec.decode`` from the decode one."""
    spec.validate()
    if prefill.role != "prefill" or decode.role != "decode":
        raise EngineConfigError("start_fleet takes a prefill template, then a decode template")
    for directory in (spec.log_dir, spec.events_dir):
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
    fleet = Fleet()
    try:
        for i in range(spec.prefill):
            fleet.prefill.append(await start_engine(engine_config(prefill, spec, i)))
        for i in range(spec.decode):
            fleet.decode.append(await start_engine(engine_config(decode, spec, i)))
    except BaseException:
        await fleet.close()
        raise
    return fleet


async def serve_fleet(prefill: EngineConfig, decode: EngineConfig, spec: FleetSpec,
                      ready_file: str | None = None) -> None:
    """Run the fleet until SIGTERM/SIGINT; write ``ready_file`` (every engine's ports) once listening."""
    fleet = await start_fleet(prefill, decode, spec)
    try:
        if ready_file:
            write_ready_file(ready_file, fleet.describe())
        print(f"kvdiag sim fleet: {spec.prefill} prefill and {spec.decode} decode engines; put them behind a "
              f"router with\n  kvdiag router {' '.join(fleet.router_args())}", flush=True)
        await wait_for_stop_signal()
    finally:
        with contextlib.suppress(Exception):
            await fleet.close()
