"""``python -m staleflow train``: the per-rank entry point, run by torchrun on every rank.

Steps on every rank:
  1. parse the config (tyro, --preset) and resolve its mode once; read torchrun's environment
     and assign the role; build or check the model folder (before any process group exists);
  2. pick and set the rank's device (cuda:LOCAL_RANK, or cpu), join the world process group
     (gloo: control only) and create the trainer group (NCCL on GPU, gloo on CPU): launch/dist.py;
  3. global rank 0 starts the controller process (before CUDA is touched) and broadcasts the
     run id; every rank connects to the controller, registers its pid, loads the model, reports Ready;
  4. run the role's loop until the controller says Shutdown; say Goodbye; clean up.
The exit code is non-zero when the run failed; rank 0 returns the controller's exit code.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
import uuid
from dataclasses import dataclass

from staleflow.config import ConfigError, PRESETS, RunConfig, resolve
from staleflow.launch import dist as rankdist
from staleflow.launch.cleanup import claim_run_folder, cleanup_stale_run_files, remove_run_folder
from staleflow.launch.control import ControlClient, control_address
from staleflow.launch.messages import Failure, Goodbye, Heartbeat, Ping, Pong, Ready, Register, Shutdown
from staleflow.launch.roles import Roles
from staleflow.model.aliases import AliasError
from staleflow.model.hf import ModelLoadError


class RunStopped(RuntimeError):
    """The controller ended the run (ok=False) or disappeared."""


@dataclass
class RankContext:
    """What a rank's loop needs: its identity, the config, the control client and process groups."""

    cfg: RunConfig
    roles: Roles
    rank: int
    run_id: str
    client: ControlClient
    run_dir: str = ""
    trainer_group: object = None
    device: str = "cpu"
    """This rank's device (launch/dist.py): cuda:LOCAL_RANK on a GPU node, else cpu."""

    @property
    def role(self) -> str:
        return self.roles.role(self.rank)

    def recv(self, timeout_s: float):
        """Next controller message other than a heartbeat; raises RunStopped on Shutdown(ok=False).

        After a SIGTERM (torchrun stops every rank when one dies) a trainer rank keeps serving
        for a grace period, so the controller can still have it save a checkpoint.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if _TERM["at"] is not None:
                grace = TERM_GRACE_S if self.role == "trainer" else 0.0
                if time.monotonic() - _TERM["at"] > grace:
                    raise KeyboardInterrupt("signal SIGTERM")
                deadline = min(deadline, _TERM["at"] + grace)
            msg = self.client.recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                return None
            if isinstance(msg, Heartbeat):
                self._last_heartbeat = time.monotonic()
                continue
            if isinstance(msg, Shutdown) and not msg.ok:
                raise RunStopped(msg.reason)
            return msg


def _make_run_dir(cfg: RunConfig) -> str:
    """The run folder: --resume's folder, or --log.run-dir/--log.name (default: a timestamp)."""
    if cfg.resume:
        if not os.path.isdir(os.path.join(cfg.resume, "checkpoints")):
            raise ConfigError(f"--resume={cfg.resume!r} is not a run folder with checkpoints/: give the folder a "
                              f"previous run printed as its run folder")
        return cfg.resume
    name = cfg.log.name or time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(cfg.log.run_dir, name)
    if cfg.log.name and os.path.exists(path) and os.listdir(path):
        raise ConfigError(f"--log.name={cfg.log.name!r}: {path} already exists; choose another name or --resume {path}")
    n = 1
    while os.path.exists(path):
        path, n = os.path.join(cfg.log.run_dir, f"{name}-{n}"), n + 1
    os.makedirs(path)
    return path


def _start_controller(cfg: RunConfig, run_id: str, world_size: int, run_dir: str):
    import multiprocessing as mp

    from staleflow.launch.controller import controller_main

    proc = mp.get_context("spawn").Process(
        target=controller_main, args=(cfg, run_id, world_size, os.getpid(), run_dir), name="staleflow-controller", daemon=False
    )
    proc.start()
    return proc


def _load_model_info(ctx: RankContext) -> tuple[object, dict]:
    """The rank's copy of the model on its device (a vLLM rollout rank loads none: vLLM does)."""
    from staleflow.model import load_model

    if ctx.role == "rollout" and ctx.cfg.rollout.engine == "vllm" and not ctx.cfg.smoke:
        return None, {"model": ctx.cfg.model.path, "params": 0, "load_s": 0.0, "device": ctx.device}
    t0 = time.perf_counter()
    model = load_model(ctx.cfg.model.path, device=ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    return model, {"model": ctx.cfg.model.path, "params": n_params, "load_s": time.perf_counter() - t0,
                   "device": ctx.device}


def make_worker(ctx: RankContext, model):
    """The rank's worker, built before it reports Ready (rings and the Parameter Server exist by
    then); returns (worker, extra Ready info)."""
    if ctx.role == "trainer":
        from staleflow.launch.trainer_worker import TrainerWorker

        w = TrainerWorker(ctx, model)
        return w, {"version": w.trainer.version, "resume_extra": w.resume_extra if ctx.rank == 0 else {}}
    from staleflow.launch.rollout_worker import RolloutWorker

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


def run_rank(cfg: RunConfig, roles: Roles, env: rankdist.RankEnv) -> int:
    import torch.distributed as dist

    rank = env.rank
    device = rankdist.pick_device(env.local_rank)
    rankdist.set_device(device)
    trainer_group = rankdist.init_groups(roles, rank, device)
    controller = None
    if rank == 0:
        cleanup_stale_run_files()
        run_id = uuid.uuid4().hex[:10]
        claim_run_folder(run_id)
        try:
            run_dir = "" if cfg.smoke else _make_run_dir(cfg)
        except ConfigError as e:
            run_dir = f"ERROR {e}"
        if not run_dir.startswith("ERROR"):
            controller = _start_controller(cfg, run_id, roles.world_size, run_dir)
        obj = [run_id, run_dir]
    else:
        obj = [None, None]
    dist.broadcast_object_list(obj, src=0)
    run_id, run_dir = obj
    if run_dir.startswith("ERROR"):
        if rank == 0:
            print(f"staleflow: config error: {run_dir[6:]}", file=sys.stderr, flush=True)
            remove_run_folder(run_id)
        return 2
    client = ControlClient(control_address(run_id), rank)
    ctx = RankContext(cfg=cfg, roles=roles, rank=rank, run_id=run_id, client=client, run_dir=run_dir,
                      trainer_group=trainer_group, device=device)
    client.send(Register(rank=rank, role=ctx.role, pid=os.getpid(), host=socket.gethostname()))
    ok, reason = True, ""
    worker = None
    try:
        model, info = _load_model_info(ctx)
        if not cfg.smoke:
            worker, more = make_worker(ctx, model)
            info.update(more)
        client.send(Ready(rank=rank, info=info))
        _TERM["defer"] = True
        if worker is None:
            smoke_loop(ctx, model)
        else:
            worker.run()
    except RunStopped as e:  # the controller reports the cause; only rank 0 carries the exit code
        ok, reason = rank != 0, f"stopped by the controller: {e}"
    except KeyboardInterrupt:
        ok, reason = False, "interrupted"
    except Exception as e:  # report to the controller in one line, keep the traceback for the log
        ok, reason = False, f"{type(e).__name__}: {e}"
        traceback.print_exc()
        client.send(Failure(rank=rank, error=reason))
    finally:
        try:
            if worker is not None:
                worker.close()
            client.send(Goodbye(rank=rank, ok=ok, reason=reason))
        finally:
            client.close()
    code = 0 if ok else 1
    if controller is not None:
        try:
            controller.join(timeout=30)
        except KeyboardInterrupt:
            pass
        if controller.is_alive():
            controller.terminate()
            controller.join(timeout=5)
        if controller.exitcode not in (0, None):
            code = controller.exitcode if controller.exitcode > 0 else 1
        remove_run_folder(run_id)
        cleanup_stale_run_files()  # segments of ranks that died without unlinking them
    if not ok and rank == 0 and reason:
        print(f"staleflow: rank {rank}: {reason}", file=sys.stderr, flush=True)
    return code


TERM_GRACE_S = 20.0  # torchrun SIGKILLs 30 s after its SIGTERM
_TERM: dict = {"defer": False, "at": None}


def _on_sigterm(signum, _frame):
    """Before the rank loop: stop at once. In the loop: note it; RankContext.recv stops (after a grace)."""
    if not _TERM["defer"]:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
    if _TERM["at"] is None:
        _TERM["at"] = time.monotonic()


def main(argv: list[str]) -> int:
    from staleflow.cli import parse

    rank_env = os.environ.get("RANK", "0")
    try:
        cfg = resolve(parse(RunConfig, argv, PRESETS, default="smollm2-cpu", prog="staleflow train"))
        env = rankdist.read_env()
        roles = Roles(env.world_size, cfg.rollout.ranks)
    except ConfigError as e:
        if rank_env == "0":
            print(f"staleflow: config error: {e}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _prepare_model(cfg)
    except (AliasError, ModelLoadError) as e:
        if rank_env == "0":
            print(f"staleflow: {e}", file=sys.stderr, flush=True)
        return 2
    return run_rank(cfg, roles, env)


def _prepare_model(cfg: RunConfig) -> None:
    """Build (or check) the model folder before any process group exists.

    Every rank calls it; the alias cache's file lock lets one of them build while the others
    wait, and no library sees a torch.distributed rank while files are written."""
    from staleflow.model.loader import resolve_model_path

    resolve_model_path(cfg.model.path)
