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
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from pathlib import Path

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
