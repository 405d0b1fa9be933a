"""``python -m staleflow train``: the per-rank entry point, run by torchrun on every rank.

Steps on every rank:
  1. parse the config (tyro, --preset) and resolve its mode once; read torchrun's environment
     and assign the role; build or check the model folder (before any process group exists);
  2. pick and set the rank's device (cuda:LOCAL_RANK, or cpu), join the world process group
     (gloo: control only) and create the trainer group (NCCL on GPU, gloo on CPU): launch/dist.py;
  3. global rank 0 cleans up after crashed runs, picks the run folder and config (a new run,
     --resume, or an elastic restart that resumes by itself: launch/resume.py), starts the
     controller process (before CUDA is touched) and broadcasts all that; every rank connects
     to the controller, registers its pid, loads the model, reports Ready;
  4. run the role's loop until the controller says Shutdown; say Goodbye; clean up.
The exit code is non-zero when the run failed; rank 0 returns the controller's exit code
(128 + signal number when a signal stopped the run).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
import traceback
import uuid

from staleflow.cluster.exchange import broadcast_json
from staleflow.cluster.roles import Roles
from staleflow.cluster.topology import Topology
from staleflow.config import ConfigError, RunConfig, config_from_dict, resolve
from staleflow.control.messages import Failure, Goodbye, Ping, Pong, Ready, Register, Shutdown
from staleflow.control.sockets import ControlClient, ControllerGone, control_address
from staleflow.engines import engine_backend
from staleflow.faults import RankOutcome, rank_outcome, start_outcome
from staleflow.launch import dist as rankdist
from staleflow.launch.lifeline import tie_to_agent
from staleflow.presets import PRESETS
from staleflow.runfolder.elastic import elastic_pointer, is_fatal
from staleflow.runfolder.run_dir import remove_if_empty
from staleflow.runfolder.scratch import claim_run_folder, cleanup_stale_run_files, remove_run_folder
from staleflow.workers.pulse import Pulse
from staleflow.workers.rank import RankContext, RunStopped, defer_signals, install_signal_handlers, set_title

ABOUT = (
    "staleflow train: one rank of a training run; torchrun starts one per process. Start a whole run with "
    "./launch.sh [these flags] (it checks them, then starts torchrun, the controller and every rank), or "
    "python -m staleflow.launch.torchrun ... -m staleflow train [flags] on several nodes (README)."
)
"""The opening of ``train --help`` (and of ``./launch.sh --help``, which prints it)."""


def _start_controller(cfg: RunConfig, run_id: str, world_size: int, run_dir: str, topo: Topology):
    """The controller process; in a multi-node run also the per-run secret and the endpoint of its
    TCP control socket (which it reports through a pipe once bound): (process, secret, endpoint)."""
    import multiprocessing as mp

    from staleflow.runtime.process import controller_main

    ctx = mp.get_context("spawn")
    secret, endpoint, reader, writer = b"", "", None, None
    if topo.multi_node:
        from staleflow.net.curve import new_secret

        secret = new_secret()
        reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=controller_main,
        args=(cfg, run_id, world_size, os.getpid(), run_dir),
        kwargs={"topology": topo, "secret": secret, "endpoint_pipe": writer},
        name="staleflow-controller",
        daemon=False,
    )
    proc.start()
    if reader is not None:
        writer.close()
        endpoint = reader.recv_bytes(4096).decode() if reader.poll(180) else ""
        reader.close()
        if not endpoint:
            proc.terminate()
            proc.join(timeout=10)
            raise OSError(
                f"the controller did not open its TCP control socket on {topo.addrs[topo.home]} "
                f"(exit code {proc.exitcode}): see its error above; STALEFLOW_BIND_ADDR sets the address"
            )
    return proc, secret, endpoint


def _shm_refusal(cfg: RunConfig, roles: Roles, topo: Topology) -> str:
    """ "" or the one line saying this node's /dev/shm cannot hold its rollout ranks' rings (and slots)."""
    import torch

    from staleflow.launch.environment import check_shm, shm_needed

    here = sum(topo.node_of(r) == topo.home for r in roles.rollout_ranks)
    try:
        check_shm(shm_needed(cfg, roles.world_size, "cuda" if torch.cuda.is_available() else "cpu", here))
    except ConfigError as e:
        return str(e)
    return ""


def _start_run(cfg: RunConfig, defaults: RunConfig, roles: Roles, topo: Topology, flags: frozenset[str]):
    """Rank 0: clean up after crashed runs, pick the run folder and config (new, --resume or elastic
    restart), start the controller. Returns (what every rank needs, the controller, the run)."""
    from staleflow.launch.resume import prepare_run
    from staleflow.plan import at_start

    cleanup_stale_run_files()
    run_id = uuid.uuid4().hex[:10]
    claim_run_folder(run_id)
    try:
        run = None if cfg.smoke else prepare_run(cfg, defaults, flags)
    except ConfigError as e:
        return {"run_id": run_id, "error": str(e)}, None, None
    for note in run.notes if run else []:
        print(f"staleflow: {note}", file=sys.stderr, flush=True)
    cfg = run.cfg if run else cfg
    refusal = "" if cfg.smoke else at_start(cfg, roles.world_size)  # prints the memory plan
    if not refusal and not cfg.smoke:  # a ring in a too small /dev/shm dies of SIGBUS on first use
        refusal = _shm_refusal(cfg, roles, topo)
    if refusal:  # a GPU would overflow: one line naming the flag to change
        if run is not None and run.created:
            remove_if_empty(run.run_dir)
        return {"run_id": run_id, "error": refusal}, None, None
    run_dir = run.run_dir if run else ""
    try:
        controller, secret, endpoint = _start_controller(cfg, run_id, roles.world_size, run_dir, topo)
    except OSError as e:
        if run is not None and run.created:
            remove_if_empty(run.run_dir)
        return {"run_id": run_id, "error": str(e)}, None, None
    print(topo.describe(controller=endpoint), flush=True)
    # The secret crosses the network once, inside this gloo broadcast (as the run id does): see
    # docs/multinode.md for what it does and does not protect.
    shared = {
        "run_id": run_id,
        "error": "",
        "run_dir": run_dir,
        "cfg": dataclasses.asdict(cfg),
        "controller_pid": controller.pid,
        "resume_from": run.resume_from if run else "",
        "secret": secret.hex(),
        "control_endpoint": endpoint,
    }
    return shared, controller, run


def _load_model_info(ctx: RankContext) -> tuple[object, object, dict]:
    """(model, weights, info). A rollout rank's copy of the model on its device (none when its engine
    backend loads its own: rank_loads_model). A trainer rank's model on the meta device with a stream of its
    weights: the trainer shards it first and keeps only its own rows (Trainer(..., weights=...))."""
    from staleflow.model import lazy_model

    if ctx.role == "rollout" and not engine_backend(ctx.cfg).rank_loads_model and not ctx.cfg.smoke:
        return None, None, {"model": ctx.cfg.model.path, "params": 0, "load_s": 0.0, "device": ctx.device}
    t0 = time.perf_counter()
    weights = None
    if ctx.role == "trainer":
        model, stream = lazy_model(ctx.cfg.model.path)
        weights = stream()
        if ctx.cfg.smoke:  # no trainer is built: read the weights through once (a bad checkpoint fails here)
            for _ in weights:
                pass
    else:
        from staleflow.rollout.builtin_engine import load_rollout_model

        model = load_rollout_model(ctx.cfg.model, ctx.cfg.rollout, ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    return (
        model,
        weights,
        {"model": ctx.cfg.model.path, "params": n_params, "load_s": time.perf_counter() - t0, "device": ctx.device},
    )


def make_worker(ctx: RankContext, model, weights=None):
    """The rank's worker, built before it reports Ready (rings and the Parameter Server exist by
    then); returns (worker, extra Ready info)."""
    if ctx.role == "trainer":
        from staleflow.workers.trainer import TrainerWorker

        w = TrainerWorker(ctx, model, weights)
        return w, {
            "version": w.trainer.version,
            "resume_extra": w.resume_extra if ctx.rank == 0 else {},
            "build_load_s": w.load_s,
        }  # the weights are read while the trainer is built
    from staleflow.workers.rollout import RolloutWorker

    w = RolloutWorker(ctx, model)
    return w, {"instance": w.instance}


def smoke_loop(ctx: RankContext, model) -> None:
    """Answer pings until the controller says Shutdown."""
    while True:
        msg = ctx.recv(timeout_s=3600)
        if isinstance(msg, Ping):
            ctx.client.send(Pong(seq=msg.seq, payload=msg.payload))
        elif isinstance(msg, Shutdown):
            return


def _topology(roles: Roles, env: rankdist.RankEnv, replicated: bool = False) -> Topology:
    """Every rank's node (a collective), or the single-node topology when one agent runs them all."""
    if env.local_world_size == env.world_size:
        return Topology.single_node(roles, replicated)
    from staleflow.cluster.topology import gather_topology
    from staleflow.net.address import ip_towards

    addr = ip_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")))
    return gather_topology(roles, env.node_rank, env.local_rank, addr, replicated)


def run_rank(
    cfg: RunConfig, defaults: RunConfig, roles: Roles, env: rankdist.RankEnv, flags: frozenset[str] = frozenset()
) -> int:
    rank = env.rank
    device = rankdist.pick_device(env.local_rank)
    rankdist.set_device(device)
    rankdist.init_world(roles.world_size, rank)
    topo = _topology(roles, env, replicated=cfg.cluster.sharding == "hsdp")
    try:
        topo.validate(engine_backend(cfg))
    except ConfigError as e:  # every rank sees the same topology: all stop, rank 0 says why
        if rank == 0:
            print(f"staleflow: config error: {e}", file=sys.stderr, flush=True)
        return 2
    trainer_group, pull_groups, replicas = rankdist.run_groups(topo, device)
    on_home = topo.same_node(rank, 0)
    if env.local_rank == 0 and not on_home:
        cleanup_stale_run_files()  # leftovers of crashed runs on this node (rank 0 does its own)
    controller = run = None
    shared = None
    if rank == 0:
        shared, controller, run = _start_run(cfg, defaults, roles, topo, flags)
    shared = broadcast_json(shared, src=0)
    if shared["error"]:
        if rank == 0:
            print(f"staleflow: config error: {shared['error']}", file=sys.stderr, flush=True)
            remove_run_folder(shared["run_id"])
        return 2
    run_id, cfg = shared["run_id"], config_from_dict(RunConfig, shared["cfg"])
    if shared["run_dir"]:
        from staleflow.launch.resume import protect_run_folders

        protect_run_folders(cfg, shared["run_dir"])  # no extension module from a run folder, on every rank
    net = None
    if topo.multi_node:
        from staleflow.cluster.netplane import NetPlane

        net = NetPlane.open(topo, rank, run_id, bytes.fromhex(shared["secret"]), pull_groups, device)
    endpoint = control_address(run_id) if on_home else shared["control_endpoint"]
    secure = None if on_home else net.secure  # a rank off the controller's node: CURVE over TCP
    client = ControlClient(endpoint, rank, secure=secure)
    ctx = RankContext(
        cfg=cfg,
        roles=roles,
        rank=rank,
        run_id=run_id,
        client=client,
        run_dir=shared["run_dir"],
        trainer_group=trainer_group,
        replicas=replicas,
        device=device,
        resume_from=shared["resume_from"],
        controller_pid=shared["controller_pid"] if on_home else 0,
        net=net,
    )
    set_title(
        f"staleflow[trainer {rank}]" if ctx.role == "trainer" else f"staleflow[rollout {roles.instance_id(rank)}]"
    )
    client.send(Register(rank=rank, role=ctx.role, pid=os.getpid(), host=socket.gethostname(), node=env.node_rank))
    pulse = Pulse(
        lambda: ControlClient(endpoint, rank, secure=secure, pulse=True), rank, lambda: ctx.progress()
    ).start()
    ok, reason, hung, failed_code = True, "", False, 1
    worker = None
    try:
        model, weights, info = _load_model_info(ctx)
        if not cfg.smoke:
            worker, more = make_worker(ctx, model, weights)
            ctx.progress = worker.progress
            info["load_s"] += more.pop("build_load_s", 0.0)
            info.update(more)
        client.send(Ready(rank=rank, info=info))
        defer_signals(forward_to=controller.pid if controller is not None else None)
        if worker is None:
            smoke_loop(ctx, model)
        else:
            worker.run()
    except RunStopped as e:  # the controller reports the cause; only rank 0 carries the exit code ...
        # ... and, after a failure a restart may fix, the ranks of other nodes: their torchrun agents
        # restart them only if one of their workers fails.
        ok, reason = rank != 0 and (on_home or not e.restart), f"stopped: {e}"
        hung = e.controller_hung
    except (Exception, KeyboardInterrupt) as e:  # the fault table (faults.py): one line to the controller
        said = report_failure(e, client, rank)
        ok, reason, failed_code = False, said.reason, said.code
    finally:
        try:
            pulse.stop()
            if worker is not None:
                worker.close()
            try:
                client.send(Goodbye(rank=rank, ok=ok, reason=reason), timeout_s=5.0)
            except ControllerGone:
                pass
        finally:
            client.close()
            if net is not None:
                net.close()
    code = 0 if ok else failed_code  # a fatal failure exits 0: no restart (the controller marks the run, says why)
    if controller is not None:
        code = _finish_controller(controller, run_id, code, wait_s=5.0 if hung else 60.0)  # hung: no wait
        if code != 0 and run is not None and run.created:
            remove_if_empty(run.run_dir)  # died while starting: no empty run folder is left behind
        pointer = elastic_pointer()
        if code == 2 and is_fatal() and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            code = 0  # bad input: exit 0 so that torchrun does not restart; launch.sh reads the mark, exits 2
        elif pointer is not None and code in (0, 130, 143):  # finished or stopped on purpose: no restart follows
            pointer.unlink(missing_ok=True)
    if not ok and rank == 0 and reason:
        print(f"staleflow: rank {rank}: {reason}", file=sys.stderr, flush=True)
    return code


def report_failure(e: BaseException, client, rank: int) -> RankOutcome:
    """A rank's answer to an exception out of its loop, as the fault table says (faults.rank_outcome):
    a bug's traceback to the log, and Failure (fatal or not) to the controller, which names it."""
    said = rank_outcome(e)
    if said.traceback:  # bad input is said in one line (by the controller), a bug with its traceback
        traceback.print_exception(e)
    if said.report:
        try:
            client.send(Failure(rank=rank, error=said.reason, fatal=said.fatal), timeout_s=5.0)
        except ControllerGone:
            pass
    return said


def _finish_controller(controller, run_id: str, code: int, wait_s: float = 60.0) -> int:
    """Rank 0: wait for the controller (bounded), take its exit code, remove the run's files. A
    controller that outlives its wait and SIGTERM (stopped by SIGSTOP, or wedged) is SIGKILLed: a
    stopped process never acts on SIGTERM, and it would keep its reward workers forever."""
    try:
        controller.join(timeout=wait_s)
    except KeyboardInterrupt:
        controller.join(timeout=wait_s / 2)
    if controller.is_alive():
        controller.terminate()
        controller.join(timeout=5)
    if controller.is_alive():
        controller.kill()
        controller.join(timeout=5)
    if controller.exitcode not in (0, None):
        code = controller.exitcode if controller.exitcode > 0 else 1
    remove_run_folder(run_id)
    cleanup_stale_run_files()  # segments of ranks that died without unlinking them
    return code


def main(argv: list[str]) -> int:
    from staleflow.config.parse import given_flags, parse, split_preset

    rank_env = os.environ.get("RANK", "0")
    install_signal_handlers()
    tie_to_agent()  # SIGTERM when the torchrun agent dies (it started us in a session of our own)
    try:
        defaults, _ = split_preset(argv, PRESETS, "smollm2-cpu")
        cfg = resolve(parse(RunConfig, argv, PRESETS, default="smollm2-cpu", prog="staleflow train", about=ABOUT))
        env = rankdist.read_env()
        roles = Roles(env.world_size, cfg.rollout.ranks)
        _prepare_model(cfg)
    except Exception as e:  # bad input (the fault table): one line from rank 0, exit 2; anything else propagates
        said = start_outcome(e)
        if said is None:
            raise
        if rank_env == "0":
            print(said[0], file=sys.stderr, flush=True)
        return said[1]
    return run_rank(cfg, defaults, roles, env, given_flags(argv))


def _prepare_model(cfg: RunConfig) -> None:
    """Build (or check) the model folder before any process group exists.

    Every rank calls it; the alias cache's file lock lets one of them build while the others
    wait, and no library sees a torch.distributed rank while files are written."""
    from staleflow.model.loader import resolve_model_path

    resolve_model_path(cfg.model.path)
