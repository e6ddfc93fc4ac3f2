"""A stand-in worker process for supervisor tests that need a misbehaving peer (no model).

`python -m tests.fake_worker MODE ENDPOINT GENERATION`:
- `contract`: announces READY with a contract version this build does not speak, then idles.
- `dead`: READY, then on the first Add a Dead frame (as an engine loop that raised) and exit 70.
- `late`: READY, then for each Add: an Outputs frame stamped with the previous generation (on a
  second socket carrying that generation's identity, as a replaced worker would send it), then
  the real finished output.
"""

from __future__ import annotations

import os
import sys
import time

from ipc.messages import CONTRACT_VERSION, Add, Dead, Outputs, Ping, Pong, Ready, Shutdown
from ipc.sockets import WorkerSocket
from worker.engine.types import FinishReason, StepOutput


def main() -> int:
    mode, endpoint, generation = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sock = WorkerSocket(endpoint, generation)
    old = WorkerSocket(endpoint, generation - 1) if mode == "late" else None
    version = CONTRACT_VERSION + 100 if mode == "contract" else CONTRACT_VERSION
    sock.send(Ready(contract_version=version, generation=generation, pid=os.getpid()))
    try:
        while True:
            sock.wait(1.0)
            while (msg := sock.recv_nowait()) is not None:
                if isinstance(msg, Ping):
                    sock.send(Pong(seq=msg.seq, generation=generation))
                elif isinstance(msg, Shutdown):
                    return 0
                elif isinstance(msg, Add) and mode == "dead":
                    sock.send(Dead(generation=generation, reason="RuntimeError: engine exploded"))
                    return 70
                elif isinstance(msg, Add) and old is not None:
                    rid = msg.request.request_id
                    old.send(Outputs(generation=generation - 1, outputs=[StepOutput(rid, text="stale")]))
                    time.sleep(0.2)  # let the stale frame arrive first
                    sock.send(Outputs(generation=generation, outputs=[StepOutput(
                        rid, text="fresh", finished=True, finish_reason=FinishReason.STOP)]))
    finally:
        sock.close()
        if old is not None:
            old.close()


if __name__ == "__main__":
    sys.exit(main())
