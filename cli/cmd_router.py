"""``kvdiag router``: the instrumented stateful P/D router (thin CLI over kvdiag.router).

Drop-in for vLLM's ``disagg_proxy_multiturn.py``: the same flags, including the space-separated
lists (``--prefiller-hosts a b --prefiller-ports 8100 8101``) and the singular aliases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kvdiag.router.config import DEFAULT_DECODER_KV_BLOCKS_TTL, POLICIES, RouterConfig, RouterConfigError, Upstream

# Options that take several space-separated values, as argparse's nargs="+" in the example proxy.
_LIST_OPTIONS = frozenset({"--prefiller-hosts", "--prefiller-host", "--prefiller-ports", "--prefiller-port",
                           "--decoder-hosts", "--decoder-host", "--decoder-ports", "--decoder-port"})


class _ProxyCompatibleCommand(click.Command):
    """Rewrites ``--opt a b`` into ``--opt a --opt b`` for the list options before click parses."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out: list[str] = []
        current: str | None = None
        for arg in args:
            if arg.startswith("-"):
                name, eq, _value = arg.partition("=")
                current = name if name in _LIST_OPTIONS and not eq else None
                out.append(arg)
                continue
            if current is not None and out and out[-1] != current:
                out.append(current)
            out.append(arg)
        return super().parse_args(ctx, out)


def _pair(role: str, hosts: tuple[str, ...], ports: tuple[int, ...]) -> tuple[Upstream, ...]:
    if len(hosts) == 1 and len(ports) > 1:
        hosts = hosts * len(ports)
    if len(hosts) != len(ports):
        raise click.ClickException(
            f"--{role}-hosts has {len(hosts)} value(s) but --{role}-ports has {len(ports)}: give one port per host "
            f"(or one host for all ports), e.g. --{role}-hosts 10.0.0.1 10.0.0.2 --{role}-ports 8100 8100")
    return tuple(Upstream(h, p) for h, p in zip(hosts, ports, strict=True))


@click.command("router", cls=_ProxyCompatibleCommand)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to bind (0 = a free one).")
@click.option("--prefiller-hosts", "--prefiller-host", "prefiller_hosts", multiple=True, default=("localhost",),
              show_default=True, help="Prefill instance hosts (space-separated list).")
@click.option("--prefiller-ports", "--prefiller-port", "prefiller_ports", type=int, multiple=True, default=(8100,),
              show_default=True, help="Prefill instance ports, one per host.")
@click.option("--decoder-hosts", "--decoder-host", "decoder_hosts", multiple=True, default=("localhost",),
              show_default=True, help="Decode instance hosts (space-separated list).")
@click.option("--decoder-ports", "--decoder-port", "decoder_ports", type=int, multiple=True, default=(8200,),
              show_default=True, help="Decode instance ports, one per host.")
@click.option("--state", default="memory", show_default=True,
              help="Conversation store: 'memory', redis://host:port/db, or redis+cluster://host:port[,host:port...] "
                   "for Redis or Valkey Cluster (Redis: shared by replicas, survives restarts).")
@click.option("--decoder-kv-blocks-ttl", type=float, default=DEFAULT_DECODER_KV_BLOCKS_TTL, show_default=True,
              help="D's decoder_kv_blocks_ttl (seconds); the router's TTL must stay below it.")
@click.option("--entry-ttl", type=float, default=None,
              help="Seconds a stored handle stays usable [default: decoder TTL - 30].")
@click.option("--max-entries", type=int, default=100_000, show_default=True, help="Store bound (LRU beyond it).")
@click.option("--last-turn-ttl", type=float, default=3600.0, show_default=True,
              help="Seconds the router remembers how a conversation's last turn ended.")
@click.option("--prefill-timeout", type=float, default=120.0, show_default=True, help="Prefill leg timeout (s).")
@click.option("--decode-timeout", type=float, default=120.0, show_default=True,
              help="Decode leg: longest wait for headers or between two reads (s).")
@click.option("--connect-timeout", type=float, default=5.0, show_default=True, help="TCP connect timeout (s).")
@click.option("--max-connections", type=int, default=1000, show_default=True, help="Upstream connection pool size.")
@click.option("--events-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write one router_turn event per turn (JSON lines).")
@click.option("--proxy-log", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write disagg_proxy_multiturn.py's text log lines here (for stock tooling).")
@click.option("--hash-ids", is_flag=True, help="Log conversation ids as sha256[:16] in events and logs.")
@click.option("--otlp-endpoint", default=None, help="OTLP/HTTP collector URL for traces, e.g. http://otel:4318.")
@click.option("--block-size", type=int, default=None,
              help="D's KV block size in tokens, to cut a handle [default: inferred per engine from its handles].")
@click.option("--template-margin-tokens", type=int, default=8, show_default=True,
              help="Tokens of a turn's generation prompt the next prompt's history may not reproduce.")
@click.option("--verify-tokens", is_flag=True,
              help="Prove reuse token by token: P's /tokenize of each prompt against D's token ids (costs a call).")
@click.option("--tokenize-shared-prefix/--no-tokenize-shared-prefix", default=True, show_default=True,
              help="When a prompt diverges from the previous one (an edit, a compaction) at a message boundary no "
                   "turn ended at, ask P's /tokenize for the shared messages' token count (cached) and reuse them.")
@click.option("--policy", type=click.Choice(POLICIES), default="round-robin", show_default=True,
              help="Where turns run: round-robin (the example proxy's), or kv-aware (the D and P that hold the "
                   "conversation's KV, while healthy and under the load bound).")
@click.option("--prefill-locality/--no-prefill-locality", default=True, show_default=True,
              help="kv-aware: keep a conversation on the P that served its last turn (P prefix caching on). "
                   "Turn off when P runs with --no-enable-prefix-caching.")
@click.option("--load-factor", type=float, default=2.0, show_default=True,
              help="kv-aware: an instance holding more than this times the mean load loses its affinity.")
@click.option("--branch-wait", type=float, default=5.0, show_default=True,
              help="kv-aware: seconds a concurrent turn of a conversation waits for the in-flight turn's prefill, "
                   "to hit that P's prefix cache.")
@click.option("--eject-after", type=int, default=5, show_default=True,
              help="Eject a P or D after this many connect errors, timeouts or 5xx in a row (0: never).")
@click.option("--eject-seconds", type=float, default=30.0, show_default=True,
              help="First ejection time; doubled on each repeat without a success in between.")
@click.option("--max-eject-seconds", type=float, default=300.0, show_default=True, help="Longest ejection.")
@click.option("--health-check-interval", type=float, default=0.0, show_default=True,
              help="Probe every P and D's GET /health this often, in seconds (0: off).")
@click.option("--health-check-timeout", type=float, default=2.0, show_default=True, help="Probe timeout (s).")
@click.option("--ready-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write {port, pid} here once listening.")
def router(**opts: Any) -> None:
    """Stateful P/D router that carries D's KV handle from one turn to the next, with per-turn telemetry."""
    config = RouterConfig(
        prefill=_pair("prefiller", opts["prefiller_hosts"], opts["prefiller_ports"]),
        decode=_pair("decoder", opts["decoder_hosts"], opts["decoder_ports"]),
        host=opts["host"], port=opts["port"], state=opts["state"],
        decoder_kv_blocks_ttl=opts["decoder_kv_blocks_ttl"], entry_ttl=opts["entry_ttl"],
        max_entries=opts["max_entries"], last_turn_ttl=opts["last_turn_ttl"],
        prefill_timeout=opts["prefill_timeout"], decode_timeout=opts["decode_timeout"],
        connect_timeout=opts["connect_timeout"], max_connections=opts["max_connections"],
        max_connections_per_host=opts["max_connections"], events_file=opts["events_file"],
        proxy_log=opts["proxy_log"], hash_ids=opts["hash_ids"], otlp_endpoint=opts["otlp_endpoint"],
        block_size=opts["block_size"], template_margin_tokens=opts["template_margin_tokens"],
        verify_tokens=opts["verify_tokens"], tokenize_shared_prefix=opts["tokenize_shared_prefix"],
        policy=opts["policy"], prefill_locality=opts["prefill_locality"],
        load_factor=opts["load_factor"], branch_wait=opts["branch_wait"], eject_after=opts["eject_after"],
        eject_seconds=opts["eject_seconds"], max_eject_seconds=opts["max_eject_seconds"],
        health_check_interval=opts["health_check_interval"], health_check_timeout=opts["health_check_timeout"])
    try:
        config.validate()
    except RouterConfigError as exc:
        raise click.ClickException(str(exc)) from None
    # (the store's Redis client and the event loop load only for a run: `--help` stays quick)
    from kvdiag.router.store import StoreError  # noqa: PLC0415
    from kvdiag.schema.process import run_event_loop  # noqa: PLC0415

    try:
        run_event_loop(_serve(config, opts["ready_file"]))
    except StoreError as exc:
        raise click.ClickException(f"{exc}. Start Redis or use --state memory.") from None
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {config.host}:{config.port}: {exc}. "
                                   "Pick another --port (0 = any free port).") from None


async def _serve(config: RouterConfig, ready_file: Path | None) -> None:
    from kvdiag.router.app import RouterHandle, serve  # noqa: PLC0415 - keeps `kvdiag --help` fast

    def announce(handle: RouterHandle) -> None:
        click.echo(f"kvdiag router: serving on {handle.url} ({len(config.prefill)} prefill, {len(config.decode)} "
                   f"decode, state {config.state.split('@')[-1]}, entry TTL {config.handle_ttl:g}s, "
                   f"policy {config.policy})")

    await serve(config, ready_file, on_ready=announce)


COMMANDS = (router,)
