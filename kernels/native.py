"""iq36's OpenVINO extension ops (kernels/native/*.cpp): built here, loaded here.

The library is compiled with the system C++ compiler against the headers and libraries of the
installed openvino wheel (no other build dependency), into the cache, keyed by the sources, the
openvino version, the compiler and the flags: `make setup` builds it, and the first use builds
it if it is missing (a few seconds). The ops are CPU ops (they run through the CPU plugin's
`evaluate`) and need AVX2, FMA and F16C.

    python -m kernels.native          build (if needed) and print the library's path
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

NATIVE = Path(__file__).parent / "native"
SOURCES = sorted(NATIVE.glob("*.cpp"))
HEADERS = sorted([*NATIVE.glob("*.hpp"), *NATIVE.glob("*.inc")])  # .inc: included more than once
LIBRARY = "libiq36_ops.so"
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-mavx2", "-mfma", "-mf16c", "-fvisibility=hidden",
         "-DNDEBUG"]
CPU_FLAGS = ("avx2", "fma", "f16c")


class NativeError(RuntimeError):
    pass


def _openvino_dir() -> Path:
    import openvino

    return Path(openvino.__file__).parent


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise NativeError("no C++ compiler: install g++ (Debian/Ubuntu: `apt-get install g++`)")
    return cxx


def _libraries(ov: Path) -> list[str]:
    """The wheel's openvino and tbb shared objects (versioned names: no unversioned symlinks)."""
    libs = ov / "libs"
    found = []
    for stem in ("libopenvino.so", "libtbb.so"):
        matches = sorted(p for p in libs.glob(f"{stem}.*") if p.name.count(".") == 2)
        if not matches:
            raise NativeError(f"{stem}.* not found in {libs}: is the openvino wheel installed?")
        found.append(str(matches[-1]))
    return found


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo); empty where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_supported() -> bool:
    return all(f in cpu_flags() for f in CPU_FLAGS)


# What the ops' bf16 paths need (`U4Experts`' `bf16` tiles); they fall back to f32 without.
BF16_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


def bf16_supported() -> bool:
    return all(f in cpu_flags() for f in BF16_CPU_FLAGS)


# AMX-BF16 (`U4Experts`' bf16 lane form on tiles, u4_experts_amx.hpp); the op also needs the
# kernel to grant the tile state, which it asks for itself.
AMX_CPU_FLAGS = ("amx_tile", "amx_bf16")


def amx_supported() -> bool:
    return bf16_supported() and all(f in cpu_flags() for f in AMX_CPU_FLAGS)


# AVX512-VNNI (`U4Experts`' `int8` tiles, u4_experts_int8.hpp): with the bf16 tiles, and not where
# AMX tiles take the lane form (the op keeps those there).
INT8_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


def int8_supported() -> bool:
    return bf16_supported() and all(f in cpu_flags() for f in INT8_CPU_FLAGS) and not amx_supported()


def require_cpu(kernel: str, error: type[Exception]) -> None:
    """Raise `error` naming `kernel` if this CPU cannot run the native ops."""
    if not cpu_supported():
        raise error(f"{kernel} needs a CPU with {', '.join(CPU_FLAGS)}")


def _key(cxx: str, ov: Path) -> str:
    import openvino

    h = hashlib.sha256()
    for src in [*SOURCES, *HEADERS]:
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    h.update("\0".join([openvino.__version__, version, *FLAGS, str(ov)]).encode())
    return h.hexdigest()[:16]


@functools.cache
def library() -> Path:
    """The built library (building it first if the cache has none for these sources)."""
    from iq36 import paths

    if not cpu_supported():
        raise NativeError(f"iq36's native ops need a CPU with {', '.join(CPU_FLAGS)}")
    ov = _openvino_dir()
    cxx = _compiler()
    out = paths.home() / "native" / _key(cxx, ov) / LIBRARY
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / LIBRARY
        cmd = [cxx, *FLAGS, f"-I{ov / 'include'}", *map(str, SOURCES), *_libraries(ov),
               f"-Wl,-rpath,{ov / 'libs'}", "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise NativeError(f"building {LIBRARY} failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        os.replace(partial, out)  # atomic: a concurrent build of the same key writes the same bytes
    return out


@functools.cache
def factory() -> Any:
    """An openvino NodeFactory that can create iq36's ops (`factory().create("U8Linear", ...)`)."""
    from openvino.utils.node_factory import NodeFactory

    f = NodeFactory()
    f.add_extension(str(library()))
    return f


def register(core: Any) -> None:
    """Let `core` compile and import models holding iq36's ops."""
    core.add_extension(str(library()))


def main() -> int:
    try:
        print(library())
    except NativeError as exc:
        print(f"iq36: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
