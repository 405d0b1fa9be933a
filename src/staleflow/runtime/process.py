"""The controller process: started by global rank 0 before CUDA is touched; one per run.

It binds the control plane (control/hub.py), waits for every rank to Register (pid) and become
Ready, runs the job (the smoke check, or the training loop of runtime/job.py), then
broadcasts Shutdown.

    rank 0 ──spawn──> controller  <──ZeroMQ──>  every rank (trainer and rollout)

In a multi-node run it also binds a CURVE TCP socket for the ranks on other nodes (net/curve.py)
and reports its endpoint to rank 0 through a pipe, which rank 0 broadcasts with the run secret.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

from staleflow.cluster.roles import Roles
from staleflow.control.hub import Hub, RankDied
from staleflow.control.messages import Ping, Pong
from staleflow.faults import controller_outcome
from staleflow.runfolder.elastic import mark_fatal


def smoke_job(ctl: Hub, cfg) -> None:
    """Launcher smoke run: round-trip a message with every rank and print what each loaded."""
    for rank in ctl.all_ranks:
        ctl.send(rank, Ping(rank=-1, seq=rank, payload=f"hello rank {rank}"))
    answered: set[int] = set()
    deadline = time.monotonic() + 60
    while len(answered) < ctl.roles.world_size:
        got = ctl.recv(max(0.0, deadline - time.monotonic()))
        if got is None:
            raise RankDied(f"ranks {sorted(set(ctl.all_ranks) - answered)} did not answer the smoke ping")
        rank, msg = got
        if isinstance(msg, Pong) and msg.seq == rank and msg.payload == f"hello rank {rank}":
            answered.add(rank)
    print(
        f"[controller] run {ctl.run_id}: {ctl.roles.world_size} ranks registered "
        f"({ctl.roles.num_trainer} trainer, {ctl.roles.num_rollout} rollout)",
        flush=True,
    )
    for rank in ctl.all_ranks:
        info = ctl.infos[rank]
        print(
            f"[controller]   {ctl.describe(rank)}: model {info.get('model', '?')} "
            f"{info.get('params', 0) / 1e6:.1f}M params, loaded in {info.get('load_s', 0):.1f}s",
            flush=True,
        )
    print("[controller] smoke run OK: every rank registered, loaded the model and answered", flush=True)
    # STALEFLOW_SMOKE_HOLD_S keeps the run alive (with liveness checks) so tests can kill a rank.
    hold_until = time.monotonic() + float(os.environ.get("STALEFLOW_SMOKE_HOLD_S", "0"))
    while time.monotonic() < hold_until:
        ctl.recv(min(0.2, max(0.0, hold_until - time.monotonic())))


def controller_main(
    cfg,
    run_id: str,
    world_size: int,
    parent_pid: int,
    run_dir: str = "",
    job: Callable | None = None,
    topology=None,
    secret: bytes = b"",
    endpoint_pipe=None,
) -> None:
    """Entry point of the controller process (multiprocessing spawn target). Exits 0 on success.

    ``topology`` (cluster/topology.py) with ranks on other nodes: ``secret`` keys the TCP socket and
    its endpoint goes back to rank 0 through ``endpoint_pipe``."""
    roles = Roles(world_size, cfg.rollout.ranks)
    secure = None
    if topology is not None and topology.multi_node:
        from staleflow.net.curve import RunKeys, SecureContext

        secure = SecureContext(RunKeys(secret, world_size), "controller")
    ctl = None
    try:
        ctl = Hub(
            run_id=run_id,
            roles=roles,
            parent_pid=parent_pid,
            run_dir=run_dir,
            topology=topology,
            secure=secure,
            remote_lost_s=cfg.fault.remote_lost_s,
        )
    finally:
        if endpoint_pipe is not None:  # an empty endpoint tells rank 0 that binding failed
            endpoint_pipe.send_bytes((ctl.server.tcp_endpoint if ctl is not None else "").encode())
            endpoint_pipe.close()

    from staleflow.workers.rank import set_title

    set_title("staleflow[controller]")
    stop_signal = {"num": signal.SIGINT}

    def on_signal(signum, _frame):
        if not ctl.stop_requested:
            ctl.stop_requested = f"stopped by signal {signal.Signals(signum).name}"
            ctl.stop_at = time.monotonic()
            stop_signal["num"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        ctl.wait_ready(timeout_s=float(os.environ.get("STALEFLOW_READY_TIMEOUT", "600")))
        if job is None:
            job = smoke_job if cfg.smoke else _training_job()
        job(ctl, cfg)
        ctl.shutdown("run finished", ok=True)
    except (Exception, KeyboardInterrupt) as e:  # a dead rank, a signal, bad input or a bug: the fault table
        said = controller_outcome(e, stop_signal["num"])  # (faults.py) says the line, the restart, the code
        print(said.line, file=sys.stderr, flush=True)
        ctl.shutdown(said.reason, ok=False, wait_s=3, restart=said.restart)
        code = said.code
        if said.fatal:  # bad input: restarting the run would fail the same way
            mark_fatal(f"{type(e).__name__}: {e}")
    finally:
        ctl.close()
        if secure is not None:
            secure.close()
    sys.exit(code)


def _training_job():
    from staleflow.runtime.job import training_job

    return training_job
