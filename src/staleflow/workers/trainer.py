"""The trainer-rank loop: consume Ready staleness buffers, one optimisation step each.

    TrainStep(v, items)  read every record of buffer v from the rollout rings (the same list on
                         every trainer rank), Trainer.step, then write this rank's shards into the
                         Parameter Server slot of version v+1; the leader publishes it and reports
    SaveState            save the full training state (and export the HF policy) collectively:
                         copied to host memory, then written by a background thread while the
                         next steps train (train/checkpoint_writer.py), unless it must be durable
The first trainer rank of each trainer node creates that node's Parameter Server slots and publishes
each version there (the leader, trainer rank 0, also reports it); the starting weights are version 0.
The slots hold the rollout engines' dtype (bf16 on CUDA) and live where cluster/placement.py says: on
CUDA one piece per trainer rank on its own GPU, created by that rank; on CPU one per trainer node in
its shared memory.

In a multi-node run (ctx.net) the node's first trainer rank also receives the records that rollout
ranks of other nodes ship (mirror rings: samples wait for a record that is still on its way), and
every piece owner serves its piece to the rollout ranks of other nodes (servers/remote_weights.py).
Trainer ranks may sit on any node (FSDP2 over all of them, or HSDP: ctx.replicas); each writes its
checkpoint shards into the run folder, which every trainer node must share.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist

from staleflow.cluster.placement import slot_dtype, slot_placement
from staleflow.cluster.topology import Topology
from staleflow.control.messages import Saved, SaveState, Shutdown, StepDone, TrainStep
from staleflow.durable import disk_problem
from staleflow.metrics.audit import content_digest, version_counts
from staleflow.runfolder.lock import check_visible
from staleflow.servers import ParameterServer, ParamLayout, TrajectoryRing
from staleflow.servers.mirror import read_arrived
from staleflow.train.checkpoint import (
    CheckpointDiskError,
    CheckpointError,
    begin_save,
    export_hf,
    finish_save,
    load_checkpoint,
)
from staleflow.train.checkpoint_files import reshard_note
from staleflow.train.checkpoint_writer import DISK, OK, CheckpointWriter, settle
from staleflow.train.trainer import Trainer
from staleflow.trajectory import TrajectoryTokens, model_versions


class TrainerWorker:
    def __init__(self, ctx, model, weights=None):
        """``model`` on the meta device with ``weights`` streaming its tensors: the trainer keeps
        only its own rows of each (see Trainer); a full model (weights None) is sharded as it is."""
        self.ctx = ctx
        cfg = ctx.cfg
        self.leader = ctx.rank == 0
        if ctx.net is not None:
            ctx.net.start_receiver()  # mirrors exist before Ready: the controller attaches them next
        self.device = torch.device(ctx.device)
        self.slot_dtype = slot_dtype(cfg, self.device.type)
        # the exported policy: --model.dtype (auto: bf16 on CUDA, fp32 on CPU), cast one tensor at a time on rank 0
        self.export_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            cfg.model.dtype, torch.bfloat16 if self.device.type == "cuda" else torch.float32
        )
        group = ctx.trainer_group if ctx.roles.num_trainer > 1 else None
        t0 = time.perf_counter()
        self.trainer = Trainer(
            model,
            cfg.train,
            self.device,
            process_group=group,
            temperature=cfg.rollout.temperature,
            total_steps=cfg.steps,
            max_response_tokens=cfg.rollout.max_new_tokens,  # Dr. GRPO's constant normaliser
            weights=weights,
            lora=cfg.lora,
            replicas=ctx.replicas,
        )
        self.load_s = time.perf_counter() - t0  # with lazy weights: reading them into this rank's shards
        # what a push carries: every parameter, or with LoRA the adapted projections' merged weights
        layout = ParamLayout.from_named_tensors(self.trainer.pushed(), dtype=self.slot_dtype)
        self.run_dir = ctx.run_dir
        topo = ctx.net.topo if ctx.net is not None else Topology.single_node(ctx.roles)
        self.node, self.nodes = topo.node_of(ctx.rank), len(topo.trainer_nodes)
        if ctx.run_dir and self.node != topo.home:  # checkpoints: every rank writes its shards there
            check_visible(ctx.run_dir, topo.home, self.node)
        self.resume_extra: dict = {}
        if ctx.resume_from:  # chosen by rank 0 (launch/resume.py): the newest intact checkpoint
            try:
                self.resume_extra = load_checkpoint(self.trainer, ctx.resume_from)
                note = reshard_note(ctx.resume_from, self.trainer, self.nodes) if self.leader else ""
                if note:
                    print(f"staleflow: {note}", file=sys.stderr, flush=True)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise CheckpointError(
                    f"cannot load {ctx.resume_from} into {cfg.model.path!r}: "
                    f"{str(e).splitlines()[0][:300]} (was the run started with another model?)"
                ) from None
        place = slot_placement(topo, self.device.type)
        self.node_leader = place.node_leader(self.node) == ctx.rank  # creates and publishes this node's slots
        if self.node_leader:
            self.ps = ParameterServer.create(
                ctx.run_id, layout, device=self.device, pieces=place.pieces, readers=place.readers, node=self.node
            )
        elif self.device.type == "cuda":  # this rank's own piece of each slot, on its GPU
            self.ps = ParameterServer.attach(
                ctx.run_id, timeout=120, piece=ctx.rank, device=self.device, node=self.node
            )
        else:
            self.ps = ParameterServer.attach(ctx.run_id, timeout=120, node=self.node)
        self.push(self.trainer.version)  # the starting weights are version 0 (or the resumed version)
        if ctx.net is not None:
            ctx.net.start_weight_server(self.ps)
        self.rings: dict[int, tuple[TrajectoryRing, bool]] = {}
        self._training = False
        self.writer = CheckpointWriter()  # background checkpoint writes; its host buffers are reused
        self.pending: tuple[SaveState, object] | None = None

    def _barrier(self):
        if self.ctx.roles.num_trainer > 1:
            dist.barrier(group=self.ctx.trainer_group)

    def push(self, version: int) -> float:
        """Write this rank's shards of the current weights as `version`; the leader publishes."""
        t0 = time.perf_counter()
        self.ps.begin_push(version)
        for sh in self.trainer.named_shards():
            row = math.prod(sh.global_shape[1:]) if len(sh.global_shape) > 1 else 1
            self.ps.write_shard(sh.name, sh.local, sh.row_offset * row)
        self.ps.end_push()  # one device sync for all the queued copies
        self._barrier()
        if self.node_leader:  # every trainer node publishes its own slots; none starts the next push first
            self.ps.publish(version)
        self._barrier()
        return time.perf_counter() - t0

    def _read(self, handle):
        """A record from its producer's ring on this node, or from this node's mirror of it."""
        if handle.rank not in self.rings:
            net = self.ctx.net
            self.rings[handle.rank] = (
                net.ring_reader(handle.rank)
                if net is not None
                else (TrajectoryRing.attach(self.ctx.run_id, handle.rank, timeout=30), False)
            )
        ring, mirror = self.rings[handle.rank]
        return read_arrived(ring, handle) if mirror else ring.read(handle)

    def payloads(self, msg: TrainStep) -> list[list[TrajectoryTokens]]:
        """Per group of the step, its members' payloads read back from the rings (as lists), in traj_ids order."""
        return [[self._read(handle).copy() for handle in g.handles] for g in msg.groups]

    def progress(self) -> tuple[int, bool]:
        """(micro-batch forwards so far, whether a step is running): read by the rank's pulse thread."""
        return self.trainer.forwards, self._training

    def train(self, msg: TrainStep) -> None:
        self._training = True
        try:
            self._train(msg)
        finally:
            self._training = False

    def _train(self, msg: TrainStep) -> None:
        if msg.version != self.trainer.version:
            raise RuntimeError(
                f"TrainStep for buffer {msg.version} but the trainer is at version "
                f"{self.trainer.version}: buffers must be consumed in version order"
            )
        t0 = time.perf_counter()
        payloads = self.payloads(msg)
        metrics = self.trainer.step(msg.groups, payloads)
        train_s = time.perf_counter() - t0
        push_s = self.push(self.trainer.version)
        if self.leader:
            clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
            content: dict[int, list[str]] = {}
            versions: dict[int, list[list[list[int]]]] = {}
            for g, members in zip(msg.groups, payloads):  # what was trained, by content: the audit
                for t in members:  # finds a group trained twice by it
                    content.setdefault(g.group_id, []).append(content_digest(t.prompt_ids, t.response_ids))
                    versions.setdefault(g.group_id, []).append(version_counts(model_versions(t)))
            self.ctx.client.send(
                StepDone(
                    version=self.trainer.version,
                    metrics=clean,
                    train_s=train_s,
                    push_s=push_s,
                    content=content,
                    token_versions=versions,
                )
            )

    def save(self, msg: SaveState) -> None:
        """Save (collectively). A durable save answers once the checkpoint is in place; otherwise
        the leader answers ``Saved(pending=True)`` as soon as the state is copied to host memory,
        training goes on, and the outcome follows when the background writer is done (reported at
        the next step, save or shutdown). A failure (disk full, a write error) is reported, not
        raised: the previous checkpoint stays valid and the controller decides what to do."""
        self.settle(wait=True)  # one save at a time: the previous one is finished and reported first
        root = os.path.join(self.run_dir, "checkpoints")
        try:
            final, _ = begin_save(
                self.trainer,
                root,
                extra=msg.extra,
                keep=self.ctx.cfg.checkpoint.keep,
                writer=self.writer,
                node=self.node,
                nodes=self.nodes,
            )
        except Exception as e:
            self._report(msg, error=e)
            return
        self.pending = (msg, final)
        if self.leader:
            estimate = self.writer.estimate_s(self.writer.pending_bytes)
            self.ctx.client.send(
                Saved(step=msg.step, path=str(final), pending=True, estimate_s=estimate, ticket=msg.ticket)
            )
        if not (msg.durable or msg.export_dir):
            return
        self.pending = None
        try:
            finish_save(self.trainer, self.writer, final)
            if msg.export_dir:
                from staleflow.model import resolve_model_path

                export_hf(
                    self.trainer,
                    msg.export_dir,
                    tokenizer_from=resolve_model_path(self.ctx.cfg.model.path),
                    dtype=self.export_dtype,
                )
        except Exception as e:
            self._report(msg, error=e)
            return
        self._report(msg, path=final)

    def settle(self, wait: bool) -> None:
        """Report the outcome of the background save once it is done. ``wait``: block until every
        trainer rank's writer is idle (collective; called at the same message on every rank)."""
        if wait:
            settle(self.trainer, self.writer)
        out = self.writer.poll()
        if out is None or self.pending is None:
            return
        msg, final = self.pending
        self.pending = None
        if out.code == OK:
            self._report(msg, path=final)
        else:
            self._report(msg, error=out.error, disk=out.code == DISK)

    def _report(self, msg: SaveState, path=None, error: BaseException | str | None = None, disk: bool = False) -> None:
        if not self.leader:
            return
        if error is None:
            if self.trainer.lora is not None:  # the adapters and their AdamW state, not the frozen base
                size = sum(f.stat().st_size for f in os.scandir(path) if f.is_file()) / 2**20
                print(
                    f"staleflow: checkpoint {os.path.basename(path)}: {size:.2f} MiB (LoRA adapters and their "
                    f"optimizer state; the base weights stay in --model.path)",
                    file=sys.stderr,
                    flush=True,
                )
            self.ctx.client.send(Saved(step=msg.step, path=str(path), ticket=msg.ticket))
            return
        if isinstance(error, BaseException):
            disk = isinstance(error, CheckpointDiskError) or disk_problem(error) is not None
            error = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        self.ctx.client.send(Saved(step=msg.step, path="", error=error[:400], disk=disk, ticket=msg.ticket))

    def run(self) -> None:
        while True:
            msg = self.ctx.recv(timeout_s=1.0)
            if isinstance(msg, TrainStep):
                self.settle(wait=False)  # a finished background save is reported; a running one goes on
                self.train(msg)
            elif isinstance(msg, SaveState):
                self.save(msg)
            elif isinstance(msg, Shutdown):
                self.settle(wait=True)
                return

    def close(self) -> None:
        for r, _ in self.rings.values():
            r.close()
        if self.ctx.net is not None and self.ctx.net.weight_server is not None:
            self.ctx.net.weight_server.close()  # before the slots it serves go
            self.ctx.net.weight_server = None
        self.ps.close()
