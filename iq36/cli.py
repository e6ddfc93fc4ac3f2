"""The `iq36` command line: build and lock models, inspect profiles, serve.

Heavy imports (torch, OpenVINO) happen inside the subcommand that needs them, so `--help`
and argument errors are instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from iq36 import __version__


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors that point at the right `--help`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _fail(message: str, code: int = 1) -> NoReturn:
    print(f"iq36: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def resolve_model(name_or_dir: str) -> Path:
    """A dev model name resolves to its cached build; anything else is a model directory."""
    from iq36.devmodels import RECIPES
    from iq36.devmodels.build import cached

    if name_or_dir in RECIPES:
        path = cached(name_or_dir)
        if path is None:
            _fail(f"dev model {name_or_dir!r} is not built yet: run `iq36 model build {name_or_dir}`")
        return path
    path = Path(name_or_dir).expanduser()
    if not path.is_dir():
        _fail(f"model {name_or_dir!r} is neither a dev model name ({', '.join(RECIPES)}) "
              "nor a directory")
    return path.resolve()


# --- model -----------------------------------------------------------------------------------

def _cmd_model_build(args: argparse.Namespace) -> None:
    from iq36.devmodels.build import BuildError, build

    try:
        path = build(args.name, out=args.out, force=args.force, progress=not args.quiet)
    except BuildError as exc:
        _fail(str(exc))
    print(path)


def _cmd_model_path(args: argparse.Namespace) -> None:
    print(resolve_model(args.name))


def _cmd_model_list(args: argparse.Namespace) -> None:
    from iq36.devmodels import RECIPES
    from iq36.devmodels.build import cached, default_dir

    for name, recipe in RECIPES.items():
        path = cached(name)
        state = str(path) if path else f"not built ({default_dir(name).name})"
        print(f"{name:14} {recipe.description}\n{'':14} {state}")


def _cmd_model_verify(args: argparse.Namespace) -> None:
    from iq36.manifest import IdentityError, IdentityMode, verify

    model_dir = resolve_model(args.model)
    try:
        result = verify(model_dir, IdentityMode(args.identity))
    except IdentityError as exc:
        _fail(f"verify failed: {exc}")
    print(f"ok {result.fingerprint} ({result.files} files, {result.mode.value})")


def _cmd_model_lock(args: argparse.Namespace) -> None:
    from iq36.manifest import MANIFEST, build_manifest, write_manifest
    from worker.identity import runtime_identity

    model_dir = Path(args.dir).expanduser().resolve()
    if not (model_dir / "openvino_model.xml").is_file():
        _fail(f"{model_dir} has no openvino_model.xml: is it an optimum-intel OpenVINO export?")
    if (model_dir / MANIFEST).exists() and not args.force:
        _fail(f"{model_dir / MANIFEST} exists: pass --force to re-lock")
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    with tqdm(total=total, unit="B", unit_scale=True, desc="hashing", file=sys.stderr,
              disable=args.quiet) as bar:
        manifest = build_manifest(model_dir, runtime_identity(), progress=bar.update)
    write_manifest(model_dir, manifest)
    print(manifest["fingerprint"])


# --- profile ---------------------------------------------------------------------------------

def _cmd_profile_show(args: argparse.Namespace) -> None:
    import msgspec

    from iq36.profile import ProfileError, load

    try:
        prof = load(args.profile)
    except ProfileError as exc:
        _fail(str(exc))
    print(json.dumps({"hash": prof.hash, **msgspec.to_builtins(prof)}, indent=2))


# --- serve -----------------------------------------------------------------------------------

def _cmd_serve(args: argparse.Namespace) -> None:
    from gateway.auth import AuthConfigError
    from gateway.server import BindError
    from iq36.profile import ProfileError
    from worker.control import ControlError
    from worker.main import options_from_args, run_service

    model_dir = resolve_model(args.model)
    try:
        raise SystemExit(run_service(options_from_args(model_dir, args)))
    except (ProfileError, ControlError, ValueError, AuthConfigError, BindError) as exc:
        _fail(str(exc))


# --- ctl -------------------------------------------------------------------------------------

def _cmd_ctl(args: argparse.Namespace) -> None:
    from worker.control import ControlError, request
    from worker.settings import ServiceSettings

    path = args.socket or ServiceSettings.build(state_dir=args.state_dir).control_socket_path
    try:
        result = request(path, args.action, timeout=args.timeout)
    except ControlError as exc:
        _fail(str(exc))
    print(json.dumps(result, indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="iq36",
        description="Specialised OpenVINO inference engine and OpenAI-compatible service for "
        "Qwen3.6-35B-A3B int4 (batch size 1, one machine).",
    )
    parser.add_argument("--version", action="version", version=f"iq36 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    model = sub.add_parser("model", help="build, lock and verify models",
                           description="Build dev models; lock and verify model identity.")
    msub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True,
                                parser_class=_Parser)
    from iq36.devmodels import RECIPES

    p = msub.add_parser("build", help="build a dev model (cached by content key)",
                        description="Build a dev model offline and deterministically. Cached under "
                        "$IQ36_HOME/models (default ~/.cache/iq36); prints the model dir last.")
    p.add_argument("name", choices=list(RECIPES), metavar="NAME",
                   help=f"one of: {', '.join(RECIPES)}")
    p.add_argument("--out", type=Path, help="build into this directory instead of the cache")
    p.add_argument("--force", action="store_true", help="rebuild even if already built")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_cmd_model_build)

    p = msub.add_parser("path", help="print the directory of a built dev model")
    p.add_argument("name", metavar="NAME_OR_DIR")
    p.set_defaults(func=_cmd_model_path)

    p = msub.add_parser("list", help="list dev models and whether they are built")
    p.set_defaults(func=_cmd_model_list)

    p = msub.add_parser("verify", help="check a model dir against its manifest",
                        description="Rehash the model's files (cached by path/size/mtime/inode) and "
                        "compare with manifest.json. Exit 1 naming the differing file and both hashes.")
    p.add_argument("model", metavar="NAME_OR_DIR")
    p.add_argument("--identity", choices=["full", "metadata"], default="full",
                   help="full: sha256 of every file (default); metadata: file set and sizes")
    p.set_defaults(func=_cmd_model_verify)

    p = msub.add_parser("lock", help="write manifest.json for a model you bring",
                        description="Hash every file of an OpenVINO model dir (e.g. the real "
                        "Qwen3.6-35B-A3B int4 export) and write manifest.json with the runtime identity.")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--force", action="store_true", help="overwrite an existing manifest")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_cmd_model_lock)

    prof = sub.add_parser("profile", help="inspect engine profiles")
    psub = prof.add_subparsers(dest="profile_command", metavar="ACTION", required=True,
                               parser_class=_Parser)
    p = psub.add_parser("show", help="print a profile and its hash")
    p.add_argument("profile", metavar="NAME_OR_PATH")
    p.set_defaults(func=_cmd_profile_show)

    p = sub.add_parser("serve", help="start the service",
                       description="Start the iq36 service on a model: a supervisor in this process "
                       "runs the worker (restarting it on crash, hang or memory-guard trip), the OpenAI-compatible "
                       "HTTP gateway serves HOST:PORT, and `iq36 ctl` is answered on the control socket. Prints one "
                       "JSON line per event (http_listening, worker_ready, worker_lost, worker_restarting, "
                       "worker_failed). SIGTERM drains: new requests get 503, running ones get IQ36_DRAIN_GRACE_S "
                       "to finish. Service settings come from IQ36_* environment variables (see worker/settings.py).")
    p.add_argument("--model", default="dev-tiny", metavar="NAME_OR_DIR",
                   help="dev model name or model directory (default: dev-tiny)")
    p.add_argument("--engine", choices=["candidate", "stock"], default="candidate")
    p.add_argument("--profile", default="cpu", metavar="NAME_OR_PATH",
                   help="engine profile (default: cpu)")
    p.add_argument("--identity", choices=["full", "metadata", "off"], default="full",
                   help="how strictly the model is checked against its manifest at start")
    p.add_argument("--expect-profile-hash", metavar="HASH",
                   help="refuse to start unless the profile hash equals this (pin from a gate report)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="durable state and the control socket (default: ~/.local/state/iq36)")
    p.add_argument("--control-socket", type=Path, metavar="PATH",
                   help="ops control socket (default: STATE_DIR/control.sock)")
    p.add_argument("--api-key-file", type=Path, metavar="FILE",
                   help="bearer keys, one per line (# comments); /health/* stays open, all else needs a key")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve on a non-loopback host without an API key (something in front authenticates)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send (default: the dev model name or the model dir's name)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("ctl", help="operate a running service over its control socket",
                       description="Talk to a running `iq36 serve` over its control socket (local, "
                       "mode 0600). status: worker pid/generation/state/RSS, restarts by reason, model "
                       "fingerprint, queue depth (JSON); restart-worker: replace the worker (a running "
                       "request ends with worker_lost); drain: stop admitting requests; resume: admit again.")
    p.add_argument("action", choices=["status", "restart-worker", "drain", "resume"], metavar="ACTION",
                   help="status | restart-worker | drain | resume")
    p.add_argument("--socket", type=Path, metavar="PATH",
                   help="control socket (default: STATE_DIR/control.sock)")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="the service's state dir (default: ~/.local/state/iq36)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds to wait for an answer")
    p.set_defaults(func=_cmd_ctl)

    from iq36.gate.cli import add_parsers as add_gate_parsers

    add_gate_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
