"""Runtime identity: the OpenVINO stack the worker computes with.

Part of the locked identity (SPEC §2): a model is locked together with the runtime that
produced and validated it, because a different openvino / genai / tokenizers build can change
numerics. Imports OpenVINO, so it lives in the worker, never in the gateway.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from iq36.manifest import HashCache, IdentityError, IdentityMode, read_manifest, verify
from iq36.profile import Profile


def runtime_identity() -> dict[str, str]:
    import openvino
    import openvino_genai
    import openvino_tokenizers

    return {
        "openvino": openvino.get_version(),
        "openvino_genai": openvino_genai.get_version(),
        "openvino_tokenizers": openvino_tokenizers.__version__,
    }


def check(
    model_dir: Path,
    profile: Profile,
    mode: IdentityMode,
    expect_profile_hash: str | None = None,
    cache: HashCache | None = None,
) -> dict[str, Any]:
    """Check model, runtime and profile identity at worker start; return all three.

    Raises IdentityError with a message naming what differs. With mode OFF nothing but the
    manifest's own consistency is checked (development only).
    """
    verified = verify(model_dir, mode, cache)
    runtime = runtime_identity()
    locked_runtime = read_manifest(model_dir).get("runtime")
    if mode is not IdentityMode.OFF and locked_runtime is not None:
        for key, have in runtime.items():
            want = locked_runtime.get(key)
            if want is not None and want != have:
                raise IdentityError(
                    f"runtime {key} is {have}, but {model_dir.name} was locked with {want}: "
                    "install the pinned versions (`make setup`) or re-lock after re-running the gate"
                )
    if expect_profile_hash is not None and profile.hash != expect_profile_hash:
        raise IdentityError(
            f"profile {profile.name} ({profile.source}) hashes to {profile.hash}, "
            f"expected {expect_profile_hash}"
        )
    return {
        "model": {"dir": str(model_dir), "fingerprint": verified.fingerprint, "identity": mode.value},
        "runtime": runtime,
        "profile": {"name": profile.name, "hash": profile.hash},
    }
