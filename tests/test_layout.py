"""Architecture rules that code review would otherwise have to remember (SPEC §1, STYLE.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _imports(package: str) -> set[str]:
    found = set()
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_gateway_never_imports_openvino() -> None:
    assert not {"openvino", "openvino_genai", "openvino_tokenizers", "numpy"} & _imports("gateway")


def test_front_end_modules_load_no_openvino() -> None:
    """The gateway embeds the supervisor; importing them (and the wire contract) must not
    pull OpenVINO into the front-end process, even transitively."""
    modules = ["gateway", "ipc", "worker.supervisor", "worker.control", "worker.settings", "worker.errors",
               "worker.engine.types"]
    modules += [f"gateway.{p.stem}" for p in (REPO / "gateway").glob("*.py") if p.stem != "__init__"]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('openvino', 'openvino_genai', 'openvino_tokenizers', 'torch')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_no_pickle_on_the_wire() -> None:
    for package in ("ipc", "gateway", "worker"):
        assert "pickle" not in _imports(package), package


def test_design_card_layout_exists() -> None:
    for name in ("pyproject.toml", "gateway", "ipc", "worker", "kernels", "profiles", "tests",
                 "deploy", "LICENSE", "README.md", "Makefile", ".ci/run"):
        assert (REPO / name).exists(), name
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert "make test" in (REPO / ".ci/run").read_text()
