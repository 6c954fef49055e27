"""``kvdiag sim prefill|decode|fleet|calibrate``: the GPU-free P/D testbed engines (thin CLI over kvdiag.sim)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Final

import click

from kvdiag.sim.config import REASONING_FIELDS, REASONING_PARSERS, TOOL_CALL_PARSERS, EngineConfig, EngineConfigError
from kvdiag.sim.faults import POLICIES, FaultError, parse_fail_transfers
from kvdiag.sim.timemodel import PROFILES, UnknownProfile, calibrate


@click.group("sim")
def sim() -> None:
    """Emulated vLLM prefill/decode engines (no GPU, no model) and their time model."""


# Options that name one engine's own ports, files or identity: a fleet sets them per engine.
_PER_ENGINE: Final = frozenset({"--port", "--side-channel-port", "--ready-file", "--engine-id", "--log-file",
                                "--events-file", "--engine", "--no-prefix-caching"})


def _engine_options(fn: Any) -> Any:
    return _apply(fn, _option_list())


def _fleet_engine_options(fn: Any) -> Any:
    return _apply(fn, [opt for name, opt in zip(_OPTION_NAMES, _option_list(), strict=True)
                       if name not in _PER_ENGINE])


def _apply(fn: Any, options: list[Any]) -> Any:
    for option in reversed(options):
        fn = option(fn)
    return fn


def _option_list() -> list[Any]:
    return [
        click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback)."),
        click.option("--port", type=int, default=0, show_default=True, help="OpenAI API port (0 = a free one)."),
        click.option("--side-channel-port", type=int, default=0, show_default=True,
                     help="NIXL side-channel port (remote_port in kv_transfer_params; 0 = a free one)."),
        click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
                     help="Write {port, side_channel_port, pid, engine_id} here once listening."),
        click.option("--model", default="Qwen/Qwen3-32B", show_default=True, help="Served model name."),
        click.option("--engine-id", default=None, help="NIXL engine id (default: a random uuid4)."),
        click.option("--no-bidirectional", is_flag=True, help="bidirectional_kv_xfer off (default on)."),
        click.option("--kv-recompute-threshold", type=int, default=None,
                     help="Tokens; default 64 with bidirectional, else 0 (vLLM's default)."),
        click.option("--decoder-kv-blocks-ttl", type=float, default=480.0, show_default=True,
                     help="Seconds D holds a finished request's blocks (fixed, not renewed)."),
        click.option("--kv-lease-duration", type=float, default=30.0, show_default=True,
                     help="Seconds P holds blocks for D's P->D read."),
        click.option("--no-prefix-caching", is_flag=True, help="Prefix caching off (the article's P)."),
        click.option("--kv-load-failure-policy", type=click.Choice(POLICIES), default="fail", show_default=True),
        click.option("--hang-on-recompute", is_flag=True,
                     help="With policy recompute, reproduce vLLM 0.33's hang in WAITING_FOR_REMOTE_KVS."),
        click.option("--no-stream-kv-params", is_flag=True,
                     help="Streamed responses carry no kv_transfer_params (vLLM without PR #40186)."),
        click.option("--fail-transfers", default="", metavar="TYPE[:RATE],...",
                     help="Inject NIXL failures: handshake_setup_failed, handshake_failed, transfer_failed, "
                          "transfer_setup_failed, notification_failed."),
        click.option("--fail-requests", type=float, default=0.0, help="Share of requests that fail (HTTP 500)."),
        click.option("--block-size", type=int, default=16, show_default=True),
        click.option("--num-blocks", type=int, default=16384, show_default=True, help="KV cache capacity, blocks."),
        click.option("--profile", type=click.Choice(sorted(PROFILES)), default="qwen3-32b", show_default=True),
        click.option("--time-scale", type=float, default=1.0, show_default=True,
                     help="Multiply every modelled duration (0.01 for fast tests and demos)."),
        click.option("--mode", type=click.Choice(("stock", "instrumented")), default="stock", show_default=True),
        click.option("--log-file", type=click.Path(dir_okay=False), default=None, help="vLLM-format log file."),
        click.option("--log-level", type=click.Choice(("DEBUG", "INFO", "WARNING", "ERROR"), case_sensitive=False),
                     default="INFO", show_default=True),
        click.option("--enable-log-requests", is_flag=True, help="vLLM's request logging lines."),
        click.option("--log-stats-interval", type=float, default=10.0, show_default=True,
                     help="Seconds between stat lines (VLLM_LOG_STATS_INTERVAL)."),
        click.option("--events-file", type=click.Path(dir_okay=False), default=None,
                     help="TurnEvent JSONL (instrumented mode)."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--max-tokens-default", type=int, default=16, show_default=True,
                     help="max_tokens when a request gives none."),
        click.option("--expiry-safety-margin", type=float, default=5.0, show_default=True, hidden=True),
        click.option("--pull-matching-prefix/--no-pull-matching-prefix", default=True, show_default=True,
                     help="Exact mode (instrumented P): read only the prefix D's block-hash digest proves equal "
                          "to the prompt. Off reproduces a stock P (the negative control)."),
        click.option("--prefix-digest/--no-prefix-digest", default=True, show_default=True,
                     help="Instrumented D adds kvdiag_digest (its sequence's block hashes) to its params."),
        click.option("--reasoning-parser", type=click.Choice(REASONING_PARSERS), default=None,
                     help="vLLM's reasoning parser: the trace streams as reasoning deltas instead of <think> "
                          "text in content."),
        click.option("--tool-call-parser", type=click.Choice(TOOL_CALL_PARSERS), default=None,
                     help="vLLM's tool parser: <tool_call> text becomes tool_calls."),
        click.option("--enable-auto-tool-choice", is_flag=True,
                     help='Allow tool_choice "auto" (needs --tool-call-parser, as in vLLM).'),
        click.option("--reasoning-tokens", type=int, default=None, metavar="N",
                     help="The model thinks: a trace of N words before every reply (default: only when a "
                          "request's kvdiag_sim hint asks)."),
        click.option("--tool-call-style", type=click.Choice(("compact", "template")), default="compact",
                     show_default=True, help="How the model writes tool calls: compact JSON (the template's "
                                             "re-rendering differs) or exactly the template's text."),
        click.option("--reasoning-field", type=click.Choice(REASONING_FIELDS), default="reasoning",
                     show_default=True, help="Name of the trace field (reasoning_content: vLLM before 0.11)."),
        click.option("--max-model-len", type=int, default=131_072, show_default=True,
                     help="Longest prompt accepted (tokens); /tokenize reports it."),
        click.option("--engine", type=click.Choice(("emulated", "vllm")), default="emulated", show_default=True,
                     help="vllm: vLLM's real Scheduler + instrumented NixlConnector + real NIXL on CPU "
                          "(needs the vllm extra; `make vllm-env`)."),
    ]


def _option_names() -> list[str]:
    names = []
    for option in _option_list():
        probe = option(lambda: None)  # the decorator records a click.Option on the function
        names.append(probe.__click_params__[-1].opts[0])
    return names


_OPTION_NAMES: Final = _option_names()


def _config(role: str, opts: dict[str, Any]) -> EngineConfig:
    """The EngineConfig the options describe (raises EngineConfigError or FaultError)."""
    return EngineConfig(
            role=role, host=opts["host"], port=opts.get("port", 0), side_channel_port=opts.get("side_channel_port", 0),
            model=opts["model"], engine_id=opts.get("engine_id"), block_size=opts["block_size"],
            num_blocks=opts["num_blocks"], bidirectional_kv_xfer=not opts["no_bidirectional"],
            kv_recompute_threshold=opts["kv_recompute_threshold"], decoder_kv_blocks_ttl=opts["decoder_kv_blocks_ttl"],
            kv_lease_duration=opts["kv_lease_duration"], prefix_caching=not opts["no_prefix_caching"],
            kv_load_failure_policy=opts["kv_load_failure_policy"], hang_on_recompute=opts["hang_on_recompute"],
            stream_kv_params=not opts["no_stream_kv_params"],
            fail_transfers=parse_fail_transfers(opts["fail_transfers"]), fail_requests=opts["fail_requests"],
            profile=opts["profile"], time_scale=opts["time_scale"], mode=opts["mode"], log_file=opts.get("log_file"),
            log_level=opts["log_level"].upper(), enable_log_requests=opts["enable_log_requests"],
            events_file=opts.get("events_file"), seed=opts["seed"], default_max_tokens=opts["max_tokens_default"],
            expiry_safety_margin_s=opts["expiry_safety_margin"], log_stats_interval_s=opts["log_stats_interval"],
            pull_matching_prefix=opts["pull_matching_prefix"], prefix_digest=opts["prefix_digest"],
            reasoning_parser=opts["reasoning_parser"], tool_call_parser=opts["tool_call_parser"],
            enable_auto_tool_choice=opts["enable_auto_tool_choice"], reasoning_tokens=opts["reasoning_tokens"],
            tool_call_style=opts["tool_call_style"], reasoning_field=opts["reasoning_field"],
            max_model_len=opts["max_model_len"])


def _run(role: str, opts: dict[str, Any]) -> None:
    ready_file = opts.pop("ready_file")
    if opts.pop("engine") == "vllm":
        _run_vllm(role, opts, ready_file)
        return
    try:
        config = _config(role, opts)
    except (EngineConfigError, FaultError) as exc:
        raise click.ClickException(f"{exc} (see `kvdiag sim {role} --help`)") from None
    if config.events_file and not config.instrumented:
        raise click.ClickException("--events-file needs --mode instrumented (stock mode writes only vLLM's logs)")
    # (the server and its HTTP stack load only for a run: `--help` stays quick)
    from kvdiag.schema.process import run_event_loop  # noqa: PLC0415
    from kvdiag.sim.server import serve  # noqa: PLC0415

    try:
        run_event_loop(serve(config, ready_file))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {config.host}: {exc}; pick another --port or use 0") from None


def _run_vllm(role: str, opts: dict[str, Any], ready_file: str | None) -> None:
    missing = [name for name in ("vllm", "nixl") if importlib.util.find_spec(name) is None]
    if missing:
        raise click.ClickException(
            f"--engine vllm needs vLLM + NIXL ({' and '.join(missing)} not installed); install them with "
            "`make vllm-env` (or pip install 'kvdiag[vllm]')")
    from kvdiag.sim.vllm_backend import api_server  # noqa: PLC0415 - the vLLM backend, only on request
    from kvdiag.sim.vllm_backend.options import options_from_sim  # noqa: PLC0415

    options = options_from_sim(role, opts)
    options.ready_file = ready_file
    api_server.run(options)


@sim.command("prefill")
@_engine_options
def prefill(**opts: Any) -> None:
    """Run an emulated vLLM prefill engine (kv_producer) until SIGTERM/SIGINT."""
    _run("prefill", opts)


@sim.command("decode")
@_engine_options
def decode(**opts: Any) -> None:
    """Run an emulated vLLM decode engine (kv_consumer) until SIGTERM/SIGINT."""
    _run("decode", opts)


@sim.command("fleet")
@click.option("--prefill", "n_prefill", type=int, default=4, show_default=True, help="Prefill engines.")
@click.option("--decode", "n_decode", type=int, default=4, show_default=True, help="Decode engines.")
@click.option("--no-prefill-prefix-caching", is_flag=True, help="P without prefix caching (the article's P).")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="One vLLM-format log per engine: <role>-<i>.log.")
@click.option("--events-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="One TurnEvent file per engine, <role>-<i>-events.jsonl (needs --mode instrumented).")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
              help="Write every engine's {url, port, side_channel_port, engine_id} and the router options here.")
@_fleet_engine_options
def fleet(n_prefill: int, n_decode: int, no_prefill_prefix_caching: bool, log_dir: Path | None,
          events_dir: Path | None, ready_file: str | None, **opts: Any) -> None:
    """Run an emulated xPyD fleet (default 4P+4D) in one process until SIGTERM/SIGINT."""
    from kvdiag.schema.process import run_event_loop  # noqa: PLC0415 (as in _run)
    from kvdiag.sim.fleet import MAX_ENGINES, FleetSpec, serve_fleet  # noqa: PLC0415

    if events_dir is not None and opts["mode"] != "instrumented":
        raise click.ClickException("--events-dir needs --mode instrumented (stock mode writes only vLLM's logs)")
    spec = FleetSpec(prefill=n_prefill, decode=n_decode, log_dir=log_dir, events_dir=events_dir)
    try:
        spec.validate()
        prefill_config = _config("prefill", {**opts, "no_prefix_caching": no_prefill_prefix_caching})
        decode_config = _config("decode", {**opts, "no_prefix_caching": False})
    except (EngineConfigError, FaultError) as exc:
        raise click.ClickException(f"{exc} (see `kvdiag sim fleet --help`; at most {MAX_ENGINES} per role)") \
            from None
    try:
        run_event_loop(serve_fleet(prefill_config, decode_config, spec, ready_file))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {opts['host']}: {exc}") from None


@sim.command("calibrate")
@click.option("--profile", type=click.Choice(sorted(PROFILES)), default="qwen3-32b", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def calibrate_cmd(profile: str, as_json: bool) -> None:
    """Recompute the article's TTFT table from the time model; exit 1 if a row misses by more than 15%."""
    try:
        result = calibrate(profile)
    except UnknownProfile as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        p = result["profile"]
        click.echo(f"profile {p['name']}: {p['description']}; KV {p['kv_bytes_per_token']} B/token ({p['kv_shape']}); "
                   f"new tokens per later turn = {p['new_token_share']:.0%} of the prompt")
        click.echo(f"{'row':32} {'off art':>8} {'off sim':>8} {'err':>7} {'on art':>8} {'on sim':>8} {'err':>7} "
                   f"{'D->P ms':>8}")
        for r in result["rows"]:
            click.echo(f"{r['row']:32} {r['article_ttft_off_ms']:8.0f} {r['sim_ttft_off_ms']:8.1f} "
                       f"{r['error_off']:+7.1%} {r['article_ttft_on_ms']:8.0f} {r['sim_ttft_on_ms']:8.1f} "
                       f"{r['error_on']:+7.1%} {r['sim_d2p_transfer_ms']:8.1f}")
        click.echo("all rows within 15%" if result["ok"] else "some rows miss the 15% tolerance")
    if not result["ok"]:
        raise SystemExit(1)


COMMANDS = (sim,)
