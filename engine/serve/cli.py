"""`simrun serve`'s command line: the serving scenario, the engine built and smoke-checked, the
port bound before the model build, uvicorn run with a drain on SIGINT/SIGTERM."""

import argparse
import errno
import math
import signal
import sys
from pathlib import Path
from typing import Any, Optional

from engine.serve.app import ServeLimits, build_app
from engine.serve.engine_loop import EngineLoop
from engine.serve.protocol import ServedModel
from sim.core.files import excerpt, read_json

def serve_parser() -> argparse.ArgumentParser:
    from engine.hardware import add_device_args

    p = argparse.ArgumentParser(prog="simrun serve",
                                description="Serve the paged engine behind an OpenAI-compatible HTTP API.")
    p.add_argument("--model", help="catalog model name (e.g. tiny) or a Hugging Face folder")
    p.add_argument("--scenario", type=Path, help="take model, device and engine settings from a scenario "
                                                   "(its workload is ignored)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override an engine setting, e.g. --set engine.max_num_seqs=8 (repeatable)")
    add_device_args(p)
    p.add_argument("--catalog-device", help="device catalog entry that sizes the KV pool "
                                            "(default: cpu, or the entry matching the visible GPU)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port, 0-65535 (0: any free port)")
    p.add_argument("--max-body-bytes", type=positive_int, default=ServeLimits.max_body_bytes,
                   help="larger request bodies get HTTP 413 (default %(default)s)")
    p.add_argument("--body-timeout", type=positive_number, default=ServeLimits.body_timeout_s, metavar="S",
                   help="a request body not all received within S seconds gets HTTP 408 (default %(default)s)")
    p.add_argument("--limit-concurrency", type=positive_int, default=ServeLimits.limit_concurrency, metavar="N",
                   help="uvicorn's limit: HTTP 503 for a request that arrives while N connections (its own "
                        "included) or N requests are open (default %(default)s)")
    p.add_argument("--timeout-keep-alive", type=positive_number, default=ServeLimits.keep_alive_s, metavar="S",
                   help="close a connection idle S seconds after its last answer (default %(default)s)")
    p.add_argument("--header-timeout", type=positive_number, default=ServeLimits.header_timeout_s, metavar="S",
                   help="close a connection whose request line and headers are not all received within "
                        "S seconds of its opening or its first byte after an answer (default %(default)s)")
    p.add_argument("--max-waiting", type=positive_int, default=None,
                   help="answer HTTP 429 while this many requests wait for the engine (default: no limit)")
    p.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model)")
    p.add_argument("--eos-token-id", type=int, default=None,
                   help="stop a request at this token unless it sets ignore_eos (default: the folder's "
                        "config.json eos_token_id; catalog models have none, so they run to max_tokens)")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer.json or a transformers folder: text prompts, "
                                                   "/v1/chat/completions and decoded answers (default: the "
                                                   "model folder's, when it has one)")
    p.add_argument("--temperature", type=non_negative_number, default=0.0,
                   help="sampling temperature for every request (0 = greedy)")
    p.add_argument("--shutdown-grace", type=non_negative_number, default=10.0,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM; "
                        "the rest are then aborted")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    return p


def serve_main(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    from sim.errors import UserError
    from sim.extras import require

    require("simrun serve", "torch", "fastapi", "uvicorn")

    if not args.model and not args.scenario:
        raise UserError("give --model NAME|PATH (or --scenario FILE)")
    from engine.hardware import pick_device, set_cpu_threads

    device = pick_device(args.device)
    set_cpu_threads(device, args.threads)
    scenario = serving_scenario(args, device)
    sock = bind_socket(args.host, args.port)      # before the model build: a taken port fails at once
    engine, version = _start_engine(scenario, device, args)
    served = engine.served
    host, port = sock.getsockname()[:2]
    print(f"kvtwin serve: {served.name} on {device}, {engine.runner.num_blocks} KV blocks of "
          f"{scenario.engine.block_size} tokens, max_model_len {served.max_model_len}; "
          f"listening on http://{_url_host(host)}:{port}", file=sys.stderr, flush=True)
    limits = ServeLimits(args.max_body_bytes, args.max_waiting, args.body_timeout, args.limit_concurrency,
                         args.timeout_keep_alive, args.header_timeout)
    _run_http(build_app(engine, version, limits), engine, args, limits, sock)
    return 0 if engine.error is None else 1


def serving_scenario(args, device: str):
    """Model, device and engine settings; a scenario file's workload plays no part."""
    from sim.scenario import apply_overrides, expand_variants, load_raw, validate_scenario

    base_dir = Path.cwd()
    raw: dict[str, Any] = {}
    if args.scenario:
        raw = load_raw(args.scenario)
        base_dir = args.scenario.parent.resolve()
    if args.model:
        raw["model"] = ({"hf_config": str(Path(args.model).resolve())} if Path(args.model).exists()
                        else args.model)
    if args.catalog_device or "device" not in raw:
        from engine.hardware import catalog_device_for_cuda

        raw["device"] = args.catalog_device or ("cpu" if device == "cpu" else catalog_device_for_cuda())
    if device == "cpu" and not args.scenario:    # a pool and batch a CPU turns over quickly
        raw["engine"] = {"num_blocks": 1024, "max_num_seqs": 32, "max_num_batched_tokens": 512}
    scenario = validate_scenario(apply_overrides(raw, args.overrides), base_dir=base_dir)
    variants = expand_variants(scenario, base_dir)
    if len(variants) > 1:
        from sim.errors import UserError

        raise UserError(f"{args.scenario} has variants ({', '.join(variants)}); the server runs one "
                        f"configuration: write it as its own scenario")
    return scenario


def _start_engine(scenario, device: str, args) -> tuple[EngineLoop, str]:
    """Build the model and pool, pass the smoke request (and warm up on GPU), wrap them."""
    from engine.replay import new_scheduler, smoke_check, warm_up
    from engine.runner import ModelRunner
    from sim.predict import kvtwin_version

    runner = ModelRunner.from_scenario(scenario, device, temperature=args.temperature)
    smoke_check(scenario, runner)
    if runner.device.type == "cuda":
        warm_up(scenario, runner)              # compile the kernels before the first client waits
    eos = args.eos_token_id if args.eos_token_id is not None else _config_eos(args.model)
    served = ServedModel(args.served_model_name or args.model or scenario.model.name,
                         args.model or scenario.model.name, scenario.model.vocab_size,
                         runner.max_model_len, args.temperature, eos, _tokenizer(args, scenario.model.vocab_size))
    return EngineLoop(new_scheduler(scenario, runner.num_blocks), runner, served), kvtwin_version()


def _tokenizer(args, vocab_size: int):
    """--tokenizer, else a model folder's tokenizer.json; None serves token ids only."""
    from sim.datasets import DatasetError, text_tokenizer
    from sim.errors import UserError

    path = args.tokenizer
    if path is None and args.model and (Path(args.model) / "tokenizer.json").is_file():
        path = Path(args.model)
    if path is None:
        return None
    try:
        tok = text_tokenizer(path)
    except DatasetError as e:
        raise UserError(f"--tokenizer: {e}") from None
    if tok.vocab_size > vocab_size:
        raise UserError(f"--tokenizer {path}: {tok.vocab_size} tokens, more than the model's vocabulary "
                        f"({vocab_size}): its ids would not be valid prompts")
    return tok


def _config_eos(model: Optional[str]) -> Optional[int]:
    """A Hugging Face folder's eos_token_id (the first, when it lists several)."""
    config = Path(model or "") / "config.json"
    if not model or not config.is_file():
        return None
    cfg = read_json(config, "Hugging Face config.json")
    eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
    return eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None


def port_number(text: str) -> int:
    """argparse `type=` for --port."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535)")
    return port


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a whole number >= 1")
    return value


def positive_number(text: str) -> float:
    """argparse `type=` for the timeouts: finite and > 0."""
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a finite number > 0")
    return value


def non_negative_number(text: str) -> float:
    """argparse `type=` for --temperature and --shutdown-grace."""
    value = _number(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a finite number >= 0")
    return value


def _number(text: str) -> float:
    """float(text), NaN when it is none (float() takes 'nan' and 'inf': the callers refuse them)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def bind_socket(host: str, port: int):
    """A TCP socket bound to host:port (not yet listening: uvicorn listens once the app is ready)."""
    import socket

    from sim.errors import UserError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--host {excerpt(host)}: not an address this machine can listen on ({e})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}"
                        + (" (another server holds the port; pick another --port)"
                           if getattr(e, "errno", None) == errno.EADDRINUSE else "")) from None
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def uvicorn_config(app, limits: ServeLimits, host: str, port: int, log_level: str = "warning",
                   shutdown_grace: float = 10.0):
    """uvicorn's settings for the app: the connection bounds of `limits` (the header timeout by
    kvtwin's h11 protocol, which uvicorn lacks), and a graceful-shutdown backstop (the engine aborts
    what is left after the grace period, which ends those responses; uvicorn's timeout is only for a
    connection that still hangs on)."""
    import uvicorn

    from engine.serve.http_limits import header_timeout_protocol

    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=header_timeout_protocol(limits.header_timeout_s),
                          limit_concurrency=limits.limit_concurrency, timeout_keep_alive=limits.keep_alive_s,
                          timeout_graceful_shutdown=shutdown_grace + 5)


def _run_http(app, engine: EngineLoop, args, limits: ServeLimits, sock=None) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            engine.begin_drain(signal.Signals(sig).name, args.shutdown_grace)
            super().handle_exit(sig, frame)

    config = uvicorn_config(app, limits, args.host, args.port, args.log_level, args.shutdown_grace)
    # uvicorn re-raises the signal it handled once it has shut down; by then the drain is
    # done and reported, so these handlers let the process exit with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    Server(config).run(sockets=[sock] if sock is not None else None)
