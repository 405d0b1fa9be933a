"""A rank's pulse: a thread that tells the controller every second how far the rank has got.

    pulse = Pulse(lambda: ControlClient(address, rank, pulse=True), rank, progress=lambda: (steps, busy))
    pulse.start(); ...; pulse.stop()

The rank's own loop may sit in one long call (a training step of minutes, a weight load), so
liveness cannot come from the loop's messages. The pulse thread has its own socket (identity
``p<rank>``, the same rank to the controller) and sends ``Heartbeat(rank, progress, busy)``:
``progress`` is a counter the rank's work advances (engine steps, micro-batches trained) and
``busy`` says whether the rank has work now. The controller's hub (control/hub.py) names a rank
that sent nothing for the stall limit (a stopped process: SIGSTOP, a hung machine) or that stayed
busy without progress (a hung collective, a deadlock). A stopped process stops its pulse too: its
threads are stopped with it. Snapshots are dropped, never queued without end, when the
controller is away (send_stats).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from staleflow.control.messages import Heartbeat

PULSE_S = 1.0


class Pulse:
    def __init__(
        self,
        connect: Callable[[], object],
        rank: int,
        progress: Callable[[], tuple[int, bool]],
        every_s: float = PULSE_S,
    ):
        """connect(): the pulse's own ControlClient, made in the thread that uses it (ZeroMQ
        sockets belong to one thread); progress(): (counter, busy) of the rank, read each beat."""
        self.connect, self.rank, self.progress, self.every_s = connect, rank, progress, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"staleflow-pulse-{rank}", daemon=True)
        self.beats = 0

    def start(self) -> Pulse:
        self._thread.start()
        return self

    def _run(self) -> None:
        client = self.connect()
        try:
            while not self._stop.wait(self.every_s):
                try:
                    count, busy = self.progress()
                except Exception:  # the rank is between states (its worker being built or closed)
                    count, busy = -1, False
                client.send_stats(Heartbeat(rank=self.rank, progress=int(count), busy=bool(busy)))
                self.beats += 1
        finally:
            client.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
