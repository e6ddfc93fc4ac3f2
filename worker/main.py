"""`iq36 serve`: the front-end process — supervisor, control socket, HTTP gateway, signals.

Runs one asyncio loop: the supervisor spawns and watches the worker, the control socket answers
`iq36 ctl`, Hypercorn serves the gateway app, and SIGTERM/SIGINT handlers only set an event the
loop waits on. Every supervisor event (worker_ready, worker_lost, worker_restarting,
worker_failed) and `http_listening` (host, port) is printed to stdout as one JSON line, so scripts
and tests can wait on them; logs go to stderr as JSON lines.

Shutdown (SIGTERM/SIGINT): stop admitting (503 `shutting_down`), give admitted requests
`drain_grace_s` to finish, abort what is left (streams end with an error frame), close the HTTP
server, stop the worker, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway import server as http_server
from gateway.app import Service, build_app
from gateway.auth import check_bind, load_keys
from gateway.logging import install_filter
from gateway.model import ModelInfo, SamplingDefaults
from iq36.manifest import IdentityMode
from iq36.profile import load
from worker.control import ControlServer
from worker.settings import ServiceSettings, configure_logging
from worker.supervisor import Supervisor, WorkerSpec

log = logging.getLogger(__name__)

# After the drain, how long aborted streams get to write their final frames before Hypercorn
# drops the connections.
_HTTP_CLOSE_S = 5.0


@dataclass(frozen=True)
class ServeOptions:
    spec: WorkerSpec
    settings: ServiceSettings
    host: str
    port: int
    model_name: str
    api_key_file: Path | None = None
    allow_unauthenticated: bool = False


def _print_event(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)
    if event["event"] == "worker_failed":
        print(f"iq36: error: worker g{event['generation']} {event['reason']}", file=sys.stderr, flush=True)


async def serve(opts: ServeOptions) -> int:
    settings = opts.settings
    # Configuration errors (keys, bind rule, address) surface before anything starts.
    keys = load_keys(opts.api_key_file)
    check_bind(opts.host, keys, opts.allow_unauthenticated)
    sock = http_server.bind(opts.host, opts.port)
    port = sock.getsockname()[1]
    cfg = http_server.config(sock, graceful_timeout_s=_HTTP_CLOSE_S)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)  # handlers only set; this loop dispatches
    settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    model = ModelInfo(id=opts.model_name, model_dir=opts.spec.model_dir, engine=opts.spec.engine,
                      profile=load(opts.spec.profile), defaults=SamplingDefaults.read(opts.spec.model_dir))

    def on_event(event: dict[str, Any]) -> None:
        if event["event"] == "worker_ready":
            model.on_ready(event)
        _print_event(event)

    supervisor = Supervisor(opts.spec, settings, on_event=on_event)
    model.fingerprint = supervisor.status()["model"]["fingerprint"]
    service = Service.create(supervisor, settings, model, keys)
    control = ControlServer(supervisor, settings.control_socket_path)
    await control.start()
    http_stop = asyncio.Event()
    http: asyncio.Task[None] | None = None
    try:
        await supervisor.start()
        http = asyncio.create_task(http_server.serve(build_app(service), cfg, http_stop.wait), name="iq36-http")
        _print_event({"event": "http_listening", "host": opts.host, "port": port})
        print(f"iq36: serving {model.id} on http://{opts.host}:{port} ({'bearer keys' if keys else 'no auth'}); "
              f"control socket {control.path}. Ctrl-C stops.", file=sys.stderr, flush=True)
        stopped = asyncio.create_task(stop.wait(), name="iq36-stop-signal")
        await asyncio.wait({stopped, http}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if http.done():
            http.result()  # the HTTP server failed: raise it
        log.info("stopping: draining for up to %gs", settings.drain_grace_s)
        aborted = await service.admission.drain(settings.drain_grace_s)
        if aborted:
            log.warning("aborted %d request(s) still running after the drain grace period", aborted)
            with contextlib.suppress(TimeoutError):
                await service.admission.wait_idle(_HTTP_CLOSE_S)
    finally:
        http_stop.set()
        if http is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await http
        await control.close()
        await supervisor.stop()
        service.close()  # flush the response store
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def run_service(opts: ServeOptions) -> int:
    configure_logging()
    install_filter()
    return asyncio.run(serve(opts))


def options_from_args(model_dir: Path, args: Any) -> ServeOptions:
    settings = ServiceSettings.build(state_dir=args.state_dir, control_socket=args.control_socket)
    spec = WorkerSpec(model_dir=model_dir, engine=args.engine, profile=args.profile,
                      identity=IdentityMode(args.identity), expect_profile_hash=args.expect_profile_hash,
                      warmup_tokens=settings.warmup_tokens)
    name = args.served_model_name or (args.model if not Path(args.model).expanduser().is_dir() else model_dir.name)
    return ServeOptions(spec=spec, settings=settings, host=args.host, port=args.port, model_name=name,
                        api_key_file=args.api_key_file, allow_unauthenticated=args.allow_unauthenticated)
