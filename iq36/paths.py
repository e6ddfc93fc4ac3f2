"""Where iq36 keeps what never goes into git: built models, hash cache, build logs."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Cache root: `$IQ36_HOME`, else `~/.cache/iq36`."""
    env = os.environ.get("IQ36_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "iq36"


def models_dir() -> Path:
    return home() / "models"


def checkpoints_dir() -> Path:
    return home() / "checkpoints"


def logs_dir() -> Path:
    return home() / "logs"


def hash_cache_file() -> Path:
    return home() / "hashcache.json"
