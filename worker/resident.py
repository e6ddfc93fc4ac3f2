"""Keep a memory-mapped weights file resident: every page of its mappings in this process.

OpenVINO maps the IR's weights file (`openvino_model.bin`) and the CPU plugin reads most
constants where they lie in that mapping. A page enters the process only when something first
reads it, and until then the kernel may drop it from the page cache at any time (under memory
pressure, or by a proactive reclaimer: the development VMs page out unmapped file pages after a
minute unread). The embedding table is the part that stays unread longest: a decode step reads
one row, so a token first generated after such an eviction waits on the disk (a major fault:
`dev-bench` decode steps of 26-37 ms against 21-30 on the development VM; docs/perf-log.md,
session 44), and on the real model so does the first request routed to a rarely chosen expert.

`populate` maps every page of the file's mappings into the process up front with
madvise(MADV_POPULATE_READ) (Linux 5.14 and later): one sequential read at load instead of
faults on the request path. The pages stay file-backed (shared with any other process mapping
the file, dropped by the kernel only as it would drop any mapped page) and count in the
process's RSS. ctypes releases the GIL for the call, so the worker's IO thread keeps answering.

`private_copy` goes further: it reads the file into anonymous memory of the process (on
transparent huge pages where the kernel allows), from which OpenVINO then reads the IR's
constants instead of the file's mapping. The copy is out of the page cache's reclaim altogether,
and on the development VM the decode products stream faster from it than from the page cache's
pages: `dev-bench` decode steps 3-7% shorter, `dev-bench-256` 3-5% (docs/perf-log.md, session 47).
The file is read in chunks of `READ_CHUNK`, the GIL released for each.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MADV_POPULATE_READ = 22  # <linux/mman.h>, Linux 5.14


def mappings(path: Path) -> list[tuple[int, int]]:
    """The address ranges [start, end) at which this process maps the file `path` (any name
    of it: matched by device and inode, as /proc/self/maps lists them)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    found = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or int(fields[4]) != st.st_ino or fields[3] != dev:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end))
    return found


def populate(path: Path) -> int:
    """Map every page of this process's mappings of `path` into it (MADV_POPULATE_READ);
    returns the bytes populated. Never raises: where the kernel or the platform cannot do it,
    logs why and returns what it did (the pages then come in as they are first read)."""
    try:
        ranges = mappings(path)
    except OSError as exc:
        log.warning("weights not made resident: cannot list the mappings of %s (%s)", path, exc)
        return 0
    if not ranges:
        log.info("weights not made resident: %s is not mapped (nothing to populate)", path)
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    done = 0
    for start, end in ranges:
        if madvise(start, end - start, MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            log.warning("weights not made resident: madvise(MADV_POPULATE_READ) on %s failed: %s%s", path,
                        os.strerror(err), " (needs Linux 5.14 or later)" if err == errno.EINVAL else "")
            return done
        done += end - start
    return done


# -- the weights in the process's own memory ------------------------------------------------------

MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)  # <linux/mman.h>
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64: the copy's length is rounded up to it
READ_CHUNK = 64 << 20  # one read(2) at a time: the GIL is released for each

# Every copy made in this process, by the file's identity: kept for the process's lifetime (the
# compiled models read their constants where the copy lies, and nothing tells Python when the
# last of them is gone), so engines of one model in one process share one copy.
_copies: dict[tuple[int, int, int, int], np.ndarray] = {}
_copies_lock = threading.Lock()


def private_copy(path: Path) -> np.ndarray | None:
    """The bytes of the file `path` in anonymous memory of this process (u8; never written), on
    transparent huge pages where the kernel allows it (madvise(MADV_HUGEPAGE): THP `always` or
    `madvise`), for OpenVINO to read the IR's constants from instead of the file's mapping.

    Kept for the process's lifetime and shared by every caller asking for the same file (same
    device, inode, size and modification time). Returns None where it cannot be had (no memory,
    an unreadable file): logs why, and the caller reads the file as before."""
    try:
        st = os.stat(path)
    except OSError as exc:
        log.warning("weights not copied into memory: %s", exc)
        return None
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _copies_lock:
        found = _copies.get(key)
        if found is not None:
            return found
        start = time.perf_counter()
        size = st.st_size
        try:
            buf = mmap.mmap(-1, max(HUGE_PAGE, -(-size // HUGE_PAGE) * HUGE_PAGE),
                            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            log.warning("weights not copied into memory: %.2f GB could not be mapped (%s)", size / 1e9, exc)
            return None
        try:
            buf.madvise(MADV_HUGEPAGE)
        except (OSError, AttributeError) as exc:  # no THP in this kernel: 4 KB pages
            log.info("weights copied without huge pages: madvise(MADV_HUGEPAGE) failed (%s)", exc)
        try:
            with open(path, "rb", buffering=0) as f, memoryview(buf) as view:
                done = 0
                while done < size:
                    got = f.readinto(view[done:min(size, done + READ_CHUNK)])
                    if not got:
                        raise OSError(f"{path} ended at {done} of its {size} bytes")
                    done += got
        except OSError as exc:
            log.warning("weights not copied into memory: reading %s failed (%s)", path, exc)
            return None
        data = np.frombuffer(buf, dtype=np.uint8, count=size)  # writable: OpenVINO shares no read-only array
        _copies[key] = data
        log.info("weights copied into memory: %.2f GB of %s in %.2f s (%.2f GB on huge pages)", size / 1e9,
                 path.name, time.perf_counter() - start, huge_page_bytes(data) / 1e9)
        return data


def huge_page_bytes(data: np.ndarray) -> int:
    """Bytes of the anonymous mapping holding `data` on transparent huge pages (0 where unknown)."""
    kb = mapping_field(data.__array_interface__["data"][0], "AnonHugePages")
    return 0 if kb is None else kb * 1024


def mapping_field(address: int, field: str) -> int | None:
    """The number `field` (e.g. AnonHugePages, in kB, or THPeligible) of this process's mapping
    holding `address`, as /proc/self/smaps lists it; None where there is none."""
    inside = False
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            head = line.split(maxsplit=1)[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a <= address < b
            elif inside and head == f"{field}:":
                return int(line.split()[1])
    return None
