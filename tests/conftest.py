"""Shared fixtures: the dev models the suite runs on (built once, cached by content key)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from iq36.devmodels.build import build

    return build("dev-tiny", progress=False)


@pytest.fixture(scope="session")
def tiny_f32_dir() -> Path:
    from iq36.devmodels.build import build

    return build("dev-tiny-f32", progress=False)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_dir: Path) -> Path:
    from iq36.devmodels import get_recipe
    from iq36.devmodels.build import checkpoint_dir

    return checkpoint_dir(get_recipe("dev-tiny"))
