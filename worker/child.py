"""One worker OS process: spawned, watched through its pidfd sentinel, measured, killed, reaped.

The pidfd becomes readable the instant the process exits, so a `kill -9` is seen by the event
loop at once (no polling, no SIGCHLD handler shared with the rest of the process).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import psutil

T = TypeVar("T")


class WorkerProcess(Generic[T]):
    """Generation `generation` of the worker. `end` resolves with the first reason it ends (T)."""

    def __init__(self, generation: int, argv: list[str], on_exit: Callable[[WorkerProcess[T]], None]) -> None:
        self.generation = generation
        # Own session: a terminal's Ctrl-C goes to the front end, which stops the worker itself.
        # Worker stdout joins our stderr: our stdout carries the service's event lines.
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=2, start_new_session=True)
        self.pid = self.proc.pid
        self.spawned_at = time.monotonic()
        self.last_seen: float | None = None  # time of the last frame from this generation
        self.ready_at: float | None = None
        loop = asyncio.get_running_loop()
        self.end: asyncio.Future[T] = loop.create_future()
        self.exited = asyncio.Event()
        self._on_exit = on_exit
        self._grace: asyncio.TimerHandle | None = None
        self._pidfd: int | None = os.pidfd_open(self.pid)
        loop.add_reader(self._pidfd, self._exit_seen)

    @property
    def alive(self) -> bool:
        return not self.exited.is_set()

    def describe_exit(self) -> str:
        rc = self.proc.returncode
        if rc is None:
            return "still running"
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exit code {rc}"

    def rss_bytes(self) -> int | None:
        if not self.alive:
            return None
        try:
            return int(psutil.Process(self.pid).memory_info().rss)
        except psutil.Error:
            return None

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        """One delayed callback tied to this process, cancelled when it is reaped."""
        self._grace = asyncio.get_running_loop().call_later(delay, callback)

    def kill(self) -> None:
        if self.alive:
            try:
                self.proc.kill()  # SIGKILL also ends a SIGSTOPped process
            except ProcessLookupError:
                pass

    async def reap(self) -> None:
        """Wait for the exit (kill first if you mean it) and release the pidfd."""
        await self.exited.wait()
        if self._grace is not None:
            self._grace.cancel()
        if self._pidfd is not None:
            self.proc.wait()  # already exited: returns at once
            os.close(self._pidfd)
            self._pidfd = None

    def _exit_seen(self) -> None:
        assert self._pidfd is not None
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self.proc.poll()  # reap the zombie, set returncode
        self.exited.set()
        self._on_exit(self)
