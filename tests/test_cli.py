"""`iq36 --help` and each subcommand's help are clear; wrong arguments give one-line errors."""

from __future__ import annotations

import pytest

from tests.helpers import run_cli

HELP_CASES = [
    ((), ["model", "profile", "serve", "ctl", "gate", "bench"]),
    (("model",), ["build", "verify", "lock", "list", "path"]),
    (("model", "build"), ["dev-tiny", "dev-bench", "dev-bench-256", "--out", "IQ36_HOME"]),
    (("model", "verify"), ["--identity", "manifest.json"]),
    (("model", "lock"), ["manifest.json", "DIR"]),
    (("profile", "show"), ["NAME_OR_PATH"]),
    (("gate",), ["--model", "--baseline", "--buckets", "--classes", "--blocks", "--output-tokens", "--out",
                 "--smoke", "--resume", "stock-tuned", "stock-default"]),
    (("bench",), ["--engine", "--lengths", "--output-tokens"]),
    (("serve",), ["--model", "--engine", "--port", "--state-dir", "--control-socket", "--api-key-file",
                  "--identity"]),
]


@pytest.mark.parametrize(("args", "expected"), HELP_CASES, ids=[" ".join(a) or "iq36" for a, _ in HELP_CASES])
def test_help_names_every_option(args: tuple[str, ...], expected: list[str]) -> None:
    proc = run_cli(*args, "--help")
    assert proc.returncode == 0, proc.stderr
    for word in expected:
        assert word in proc.stdout, f"{word!r} missing from `iq36 {' '.join(args)} --help`"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("model", "build", "dev-huge"), "invalid choice"),
        (("serve", "--engine", "turbo"), "invalid choice"),
        (("serve", "--port", "eighty"), "invalid int value"),
        (("frobnicate",), "invalid choice"),
        (("model",), "required"),
        (("gate", "--out", "x", "--buckets", "12a"), "comma-separated integers"),
        (("gate", "--out", "x", "--classes", "lorem"), "prompt classes are"),
        (("gate",), "required"),
    ],
)
def test_wrong_arguments_give_one_line_error(args: tuple[str, ...], needle: str) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and "--help" in lines[0]


def test_unbuilt_model_name_says_how_to_build(tmp_path) -> None:
    proc = run_cli("model", "path", "dev-bench", env={"IQ36_HOME": str(tmp_path)})
    assert proc.returncode == 1
    assert "iq36 model build dev-bench" in proc.stderr


def test_missing_model_dir_is_one_clear_error(tmp_path) -> None:
    proc = run_cli("model", "verify", str(tmp_path / "nope"))
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "neither a dev model name" in proc.stderr
