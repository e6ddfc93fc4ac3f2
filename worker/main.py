"""Worker entry point.

Until the supervised split-process core exists (issue #3), `iq36 serve` runs the worker
standalone: it checks the locked identity (model, runtime, profile), compiles the model with
the profile's device and properties, prints its identity as one JSON line and waits for
SIGINT/SIGTERM. The HTTP gateway is not part of this yet.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from iq36.manifest import IdentityError, IdentityMode
from iq36.profile import ProfileError, load
from worker.identity import check

log = logging.getLogger(__name__)


def compile_model(model_dir: Path, device: str, properties: dict[str, object]):  # -> ov.CompiledModel
    import openvino as ov

    core = ov.Core()
    return core.compile_model(core.read_model(model_dir / "openvino_model.xml"), device, properties)


def run_standalone(model_dir: Path, args: argparse.Namespace) -> int:
    try:
        profile = load(args.profile)
        identity = check(model_dir, profile, IdentityMode(args.identity), args.expect_profile_hash)
    except (ProfileError, IdentityError) as exc:
        print(f"iq36: error: worker refused to start: {exc}", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    compiled = compile_model(model_dir, profile.engine.device, dict(profile.engine.properties))
    identity["resolved"] = {
        "INFERENCE_PRECISION_HINT": str(compiled.get_property("INFERENCE_PRECISION_HINT")),
        "compile_s": round(time.monotonic() - t0, 2),
    }
    print(json.dumps({"event": "worker_ready", "engine": args.engine, **identity}), flush=True)
    print(
        f"iq36: worker ready on {model_dir.name} (engine {args.engine}); the HTTP gateway on "
        f"{args.host}:{args.port} is not built yet. Ctrl-C stops.",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    return 0
