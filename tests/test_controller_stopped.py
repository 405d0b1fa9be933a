"""Rank 0 never leaves its controller behind: one that SIGSTOP (or a wedge) keeps from exiting is
killed once its wait and SIGTERM have passed (chaos run 'stop-controller' found it left stopped,
with its reward workers, after the run had restarted and finished)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid

from staleflow.launch import entry


def _wait_forever() -> None:
    while True:
        time.sleep(1)


def test_a_stopped_controller_is_killed_on_the_way_out(monkeypatch):
    monkeypatch.setattr(entry, "cleanup_stale_run_files", lambda: [])
    proc = mp.get_context("fork").Process(target=_wait_forever, daemon=True)
    proc.start()
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        code = entry._finish_controller(proc, f"t{uuid.uuid4().hex[:8]}", 0, wait_s=0.5)
        assert not proc.is_alive()
        assert proc.exitcode == -signal.SIGKILL and code == 1  # a controller killed is a failed run
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
