"""`tpfuse serve`: the engine in its own process, the OpenAI-compatible HTTP server in this one."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable

from tpfuse.config import (
    EngineConfig,
    ServerConfig,
    add_engine_args,
    add_server_args,
    engine_config_from_args,
    server_config_from_args,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_args(parser)
    add_server_args(parser)
    parser.set_defaults(handler=_serve_command)


def _serve_command(args: argparse.Namespace) -> int:
    try:
        engine_config = engine_config_from_args(args)
        server_config = server_config_from_args(args)
    except ValueError as exc:
        print(f"tpfuse serve: {exc}", file=sys.stderr)
        return 2
    return run_server(engine_config, server_config)


def run_server(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    engine_factory: Callable | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> int:
    """Starts the engine process and serves HTTP until SIGINT/SIGTERM; then stops both.

    Prints "tpfuse server ready at URL" once the engine is loaded and the port is open (on_ready,
    if given, is called with the URL too). On a signal, requests in flight get
    --shutdown-drain-timeout seconds to finish; streams still open then end with an error event.
    Returns 0 after a clean shutdown, 1 if the engine failed to start or died during the run
    (restarted or not: a supervisor should know). engine_factory(config) builds the engine inside
    the engine process (default: LLMEngine).
    """
    import uvicorn

    from tpfuse.server.app import build_app
    from tpfuse.server.engine_client import EngineClient, EngineDied
    from tpfuse.server.engine_process import make_llm_engine
    from tpfuse.server.http_server import DrainingServer

    model_names = [server_config.served_model_name or engine_config.model]
    if server_config.served_model_name and engine_config.model not in model_names:
        model_names.append(engine_config.model)
    failed = threading.Event()

    def fatal(reason: str) -> None:
        failed.set()
        server.should_exit = True

    client = EngineClient(
        engine_config,
        engine_factory or make_llm_engine,
        restart=server_config.restart_engine,
        step_timeout_s=server_config.engine_step_timeout,
        on_fatal=fatal,
    )
    app = build_app(client, server_config, model_names)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level="warning",
            timeout_graceful_shutdown=server_config.shutdown_drain_timeout + 2,
        ),
        app,
        client,
        server_config.shutdown_drain_timeout,
    )
    client.start()

    def announce() -> None:
        try:
            client.wait_ready()
        except EngineDied as exc:
            print(f"tpfuse serve: {exc}", file=sys.stderr, flush=True)
            fatal(str(exc))
            return
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if server.started:
            url = f"http://{server_config.host}:{_bound_port(server, server_config.port)}"
            print(f"tpfuse server ready at {url} (model {model_names[0]})", flush=True)
            if on_ready is not None:
                on_ready(url)

    def stop(signum, frame) -> None:
        # uvicorn handles the signal while it serves and re-raises it on exit; this handler takes
        # that re-raise (and any signal outside uvicorn's window) so both processes stop cleanly.
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    threading.Thread(target=announce, name="tpfuse-announce", daemon=True).start()
    try:
        server.run()
    finally:
        client.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if client.num_engine_deaths:
        print(
            f"tpfuse serve: the engine died {client.num_engine_deaths} time(s) during this run",
            file=sys.stderr,
        )
    return 1 if failed.is_set() or client.num_engine_deaths or not server.started else 0


def _bound_port(server, default: int) -> int:
    try:
        return server.servers[0].sockets[0].getsockname()[1]
    except (AttributeError, IndexError):
        return default
