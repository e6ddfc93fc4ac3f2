"""Architecture rules that code review would otherwise have to remember (SPEC §1, STYLE.md)."""

from __future__ import annotations

import ast
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
    assert not {"openvino", "openvino_genai", "openvino_tokenizers", "worker"} & _imports("gateway")


def test_no_pickle_on_the_wire() -> None:
    for package in ("ipc", "gateway", "worker"):
        assert "pickle" not in _imports(package), package


def test_design_card_layout_exists() -> None:
    for name in ("pyproject.toml", "gateway", "ipc", "worker", "kernels", "profiles", "tests",
                 "deploy", "LICENSE", "README.md", "Makefile", ".ci/run"):
        assert (REPO / name).exists(), name
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert "make test" in (REPO / ".ci/run").read_text()
