"""Engine profiles shipped with iq36 (TOML). `iq36.profile.load` reads them by name or path."""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).parent


def available() -> list[str]:
    return sorted(p.stem for p in DIR.glob("*.toml"))
