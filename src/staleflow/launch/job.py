"""The training job inside the controller: prompts -> coordinator -> rollout ranks -> rewards ->
staleness buffers -> trainer ranks, until --steps weight versions exist.

One loop, single-threaded (the staleness manager and the coordinator are not thread-safe):
  1. keep the Trajectory Server queue filled with new prompt groups (N' members each);
  2. handle every message from the ranks: snapshots, finished/partial trajectories, pulls,
     finished training steps;
  3. poll the reward pool; a group whose N members are rewarded is Occupied;
  4. every tick, run the coordinator and send its Route / Pull / Interrupt / Abort commands;
  5. when buffer `version` is Ready and the trainer is idle, Consume it: send its records to
     every trainer rank; when the step is done, free the records and log the step.
Bytes never pass through here except to decode a finished response for its reward.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from staleflow.coordinator import Abort, Coordinator, InstanceSnapshot, Interrupt, Pull, Route, TrajectoryItem
from staleflow.coordinator import apply_mode, load_cost_model
from staleflow.config import parse_length_dist
from staleflow.launch.controller import RankDied
from staleflow.launch.messages import (FreeRecords, InstanceStats, InterruptTrajs, Pulled, PullWeights, RouteTraj,
                                       Saved, SaveState, StepDone, TrainItem, TrainStep, TrajDone)
from staleflow.metrics.progress import ProgressDisplay
from staleflow.metrics.writer import MetricsWriter, save_config
from staleflow.protocol import StalenessManager
from staleflow.servers import RecordHandle, TrajectoryRing


@dataclass
class Traj:
    traj_id: int
    group_id: int
    seed: int
    handle: tuple | None = None  # newest record (partial while interrupted, final when finished)
    instance: int = -1
    traj_version: int | None = None
    reward: float | None = None
    finished: bool = False
    truncate: bool = False
    target_len: int = 0  # benchmark workloads: drawn length (0 = the model decides)
    n_tokens: int = 0
    text: str = ""


@dataclass
class Group:
    group_id: int
    prompt: object  # staleflow.data.Prompt
    members: list[int] = field(default_factory=list)
    complete: bool = False  # N members finished generation


class TrainingJob:
    def __init__(self, ctl, cfg):
        from staleflow.data import PromptSource
        from staleflow.model import load_tokenizer, resolve_model_path
        from staleflow.reward import RewardPool

        self.ctl, self.cfg = ctl, cfg
        self.run_dir = ctl.run_dir
        self.coord_cfg, self.stale_cfg = apply_mode(cfg.mode, cfg.coordinator, cfg.staleness)
        s = self.stale_cfg
        self.tokenizer = load_tokenizer(resolve_model_path(cfg.model.path))
        self.source = PromptSource(cfg.data, self.tokenizer)
        self.rewards = RewardPool(cfg.reward)
        self.version = int(ctl.infos[0].get("version", 0))  # the trainer's version (resume)
        self.manager = StalenessManager(s.eta, s.batch_size, capacity=s.batch_size + s.batch_redundancy,
                                        group_size=s.group_size, group_capacity=s.group_size + s.group_redundancy,
                                        version=self.version)
        cost = load_cost_model(self.coord_cfg.cost_model)
        roles = ctl.roles
        self.rank_of = {roles.instance_id(r): r for r in roles.rollout_ranks}
        self.coord = Coordinator(self.coord_cfg, cost, self.manager, list(self.rank_of), mode=cfg.mode,
                                 straggler=s.straggler, straggler_threshold=s.straggler_threshold, version=self.version)
        self.rings = {r: TrajectoryRing.attach(ctl.run_id, r, timeout=30) for r in roles.rollout_ranks}
        self.trajs: dict[int, Traj] = {}
        self.groups: dict[int, Group] = {}
        self.next_traj = self.next_group = 0
        self.rng = random.Random(cfg.seed)
        self.length_dist = parse_length_dist(cfg.rollout.length_dist) if cfg.rollout.length_dist else None
        self.trainer_busy: tuple[int, float, list[int]] | None = None  # (version, t_sent, group ids)
        self.tokens_generated: dict[int, int] = {}
        self.counts = Counter()
        self.step_acc = defaultdict(list)  # per-step accumulators (rewards, lengths, staleness)
        self.gen_since: dict[int, float | None] = {i: None for i in self.rank_of}
        self.pull_since: dict[int, float] = {}
        self.writer = MetricsWriter(self.run_dir, tensorboard=cfg.log.tensorboard)
        save_config(self.run_dir, cfg)
        self.progress = ProgressDisplay(cfg.steps, enabled=cfg.log.progress, start=self.version)
        self._last_log = (time.monotonic(), 0, 0)  # time, tokens, samples at the previous step
        self.bound_violations = 0
        extra = ctl.infos[0].get("resume_extra") or {}
        if extra:
            self._restore(extra)

    # ---- prompts ---------------------------------------------------------------------------
    def submit_group(self, prompt) -> None:
        gid, self.next_group = self.next_group, self.next_group + 1
        g = self.groups[gid] = Group(gid, prompt)
        items = []
        for _ in range(self.stale_cfg.group_size + self.stale_cfg.group_redundancy):
            tid, self.next_traj = self.next_traj, self.next_traj + 1
            self.trajs[tid] = Traj(tid, gid, seed=self.rng.getrandbits(62), target_len=self.draw_length())
            g.members.append(tid)
            items.append(TrajectoryItem(traj_id=tid, group_id=gid, traj_version=None, prompt_len=len(prompt.prompt_ids)))
        self.coord.submit(items)

    def draw_length(self) -> int:
        if not self.length_dist:
            return 0
        median, sigma = self.length_dist
        return max(1, min(self.cfg.rollout.max_new_tokens, int(round(self.rng.lognormvariate(math.log(median), sigma)))))

    def refill(self) -> None:
        cap = self.stale_cfg.batch_size + self.stale_cfg.batch_redundancy
        limit = (self.stale_cfg.eta + 2) * cap
        while len(self.groups) < limit:
            self.submit_group(next(self.source))

    # ---- records ---------------------------------------------------------------------------
    def free(self, handles) -> None:
        by_rank = defaultdict(list)
        for h in handles:
            if h is not None:
                by_rank[h[0]].append(h)
        for rank, hs in by_rank.items():
            self.ctl.send(rank, FreeRecords(handles=hs))

    def drop_traj(self, tid: int) -> None:
        t = self.trajs.pop(tid, None)
        if t is not None:
            self.free([t.handle])
            g = self.groups.get(t.group_id)
            if g is not None and tid in g.members:
                g.members.remove(tid)

    def drop_group(self, gid: int, retry: bool) -> None:
        g = self.groups.pop(gid, None)
        if g is None:
            return
        for tid in list(g.members):
            self.drop_traj(tid)
        self.counts["groups_aborted"] += 1
        if retry:
            self.submit_group(g.prompt)

    # ---- commands --------------------------------------------------------------------------
    def execute(self, cmd) -> None:
        if isinstance(cmd, Route):
            t = self.trajs[cmd.traj_id]
            g = self.groups[t.group_id]
            t.instance, t.traj_version = cmd.instance, cmd.traj_version
            self.ctl.send(self.rank_of[cmd.instance], RouteTraj(
                traj_id=t.traj_id, group_id=t.group_id, traj_version=cmd.traj_version,
                prompt_ids=list(g.prompt.prompt_ids), seed=t.seed, partial=t.handle, max_new_tokens=t.target_len))
            self.counts["routes"] += 1
        elif isinstance(cmd, Interrupt) and cmd.instance < 0:  # queued stragglers: their partial is final
            for tid in cmd.traj_ids:
                t = self.trajs.get(tid)
                if t is None:
                    continue
                if t.handle is None:  # never generated a token: nothing to keep
                    self.coord.on_failed(-1, tid, "truncated-empty")
                    self.drop_traj(tid)
                else:
                    self.finish(t, -1, t.handle[0], t.n_tokens)
        elif isinstance(cmd, Interrupt):
            if cmd.reason == "truncate":
                for tid in cmd.traj_ids:
                    if tid in self.trajs:
                        self.trajs[tid].truncate = True
            self.ctl.send(self.rank_of[cmd.instance], InterruptTrajs(traj_ids=list(cmd.traj_ids), reason=cmd.reason))
            self.counts["interrupts"] += 1
            if cmd.reason == "migrate":
                self.counts["migrations"] += 1
        elif isinstance(cmd, Pull):
            self.pull_since[cmd.instance] = time.time()
            self.ctl.send(self.rank_of[cmd.instance], PullWeights(version=cmd.version))
            self.counts["pulls"] += 1
        elif isinstance(cmd, Abort):
            if cmd.instance >= 0:
                self.ctl.send(self.rank_of[cmd.instance], InterruptTrajs(traj_ids=list(cmd.traj_ids), reason=cmd.reason, drop=True))
            for tid in cmd.traj_ids:
                self.drop_traj(tid)
            self.counts[f"aborted_{cmd.reason}"] += len(cmd.traj_ids)
            if cmd.group_id >= 0:
                self.drop_group(cmd.group_id, cmd.retry)

    # ---- messages --------------------------------------------------------------------------
    def on_traj_done(self, rank: int, msg: TrajDone) -> None:
        t = self.trajs.get(msg.traj_id)
        if t is None:  # dropped meanwhile (abort raced the finish): its record is garbage
            self.free([msg.handle])
            return
        old, t.handle = t.handle, tuple(msg.handle)
        if old is not None and old != t.handle:
            self.free([old])
        instance = self.ctl.roles.instance_id(rank)
        if msg.partial and not t.truncate:
            t.n_tokens = msg.n_tokens
            g = self.groups[t.group_id]
            self.coord.on_interrupted(instance, [TrajectoryItem(
                traj_id=t.traj_id, group_id=t.group_id, traj_version=t.traj_version,
                prompt_len=len(g.prompt.prompt_ids), generated_len=msg.n_tokens, origin=instance)])
            return
        self.finish(t, instance, rank, msg.n_tokens)

    def finish(self, t: Traj, instance: int, rank: int, n_tokens: int) -> None:
        """Generation of `t` is over (its record is t.handle in `rank`'s ring): tell the coordinator, score it."""
        t.finished = True
        t.n_tokens = n_tokens
        for gid in self.coord.on_finished(instance, t.traj_id):
            if gid in self.groups:
                self.groups[gid].complete = True
        rec = self.rings[rank].read(RecordHandle(*t.handle))
        text = t.text = self.tokenizer.decode(rec.response_ids.tolist(), skip_special_tokens=True)
        g = self.groups[t.group_id]
        self.rewards.submit(t.traj_id, text, g.prompt.answer, dict(g.prompt.meta))
        self.step_acc["response_len"].append(n_tokens)

    def on_reward(self, tid: int, reward: float) -> None:
        t = self.trajs.get(tid)
        if t is None:
            return
        t.reward = reward
        self.maybe_occupy(t.group_id)

    def maybe_occupy(self, gid: int) -> None:
        g = self.groups.get(gid)
        if g is None or not g.complete:
            return
        done = [self.trajs[m] for m in g.members if self.trajs[m].finished]
        if len(done) < self.stale_cfg.group_size or any(t.reward is None for t in done):
            return
        self.coord.on_rewarded(gid)

    def on_stats(self, msg: InstanceStats) -> None:
        self.tokens_generated[msg.instance] = msg.tokens_generated
        self.coord.on_snapshot(InstanceSnapshot(
            instance=msg.instance, version=msg.version, running=msg.running, waiting=msg.waiting,
            kv_tokens=msg.kv_tokens, kv_capacity=msg.kv_capacity, tokens_per_s=msg.tokens_per_s, syncing=False,
            time=msg.time, traj_ids=tuple(msg.traj_ids)))
        busy = msg.running + msg.waiting > 0
        since = self.gen_since[msg.instance]
        if busy and since is None:
            self.gen_since[msg.instance] = time.time()
        elif not busy and since is not None:
            self.writer.log_span(self.rank_of[msg.instance], "generate", since, time.time())
            self.gen_since[msg.instance] = None

    def on_pulled(self, rank: int, msg: Pulled) -> None:
        self.coord.on_pull_done(msg.instance, msg.version)
        t0 = self.pull_since.pop(msg.instance, time.time() - msg.seconds)
        self.writer.log_span(rank, "pull", t0, time.time(), version=msg.version)

    def handle(self, rank: int, msg) -> None:
        if isinstance(msg, InstanceStats):
            self.on_stats(msg)
        elif isinstance(msg, TrajDone):
            self.on_traj_done(rank, msg)
        elif isinstance(msg, Pulled):
            self.on_pulled(rank, msg)
        elif isinstance(msg, StepDone):
            self.on_step_done(msg)
        else:
            raise RuntimeError(f"unexpected message {type(msg).__name__} from rank {rank}")

    # ---- training ----------------------------------------------------------------------------
    def maybe_train(self) -> None:
        if self.trainer_busy is not None or self.version >= self.cfg.steps:
            return
        if self.manager.ready_version() != self.version:
            return
        gids = self.manager.consume(self.version)
        items = []
        for gid in gids:
            g = self.groups[gid]
            members = [self.trajs[m] for m in g.members if self.trajs[m].finished]
            V = min(t.traj_version for t in members)
            stale = self.version - V
            self.step_acc["staleness"].append(stale)
            if not 0 <= stale <= self.stale_cfg.eta:
                self.bound_violations += 1
            for t in members:
                self.step_acc["trained_tokens"].append(t.n_tokens)
                items.append(TrainItem(handle=t.handle, reward=float(t.reward), group_id=gid, traj_version=V))
                self.step_acc["reward"].append(float(t.reward))
            self.writer.log_trained(self.version, gid, V, [t.traj_id for t in members], [t.reward for t in members],
                                    prompt=g.prompt.text, answer=g.prompt.answer, sample=members[0].text)
        self.ctl.broadcast(TrainStep(version=self.version, items=items), ranks=self.ctl.roles.trainer_ranks)
        self.trainer_busy = (self.version, time.time(), gids)

    def on_step_done(self, msg: StepDone) -> None:
        v_trained, t_sent, gids = self.trainer_busy
        self.trainer_busy = None
        now = time.time()
        self.writer.log_span(0, "train", t_sent, now - msg.push_s)
        self.writer.log_span(0, "push", now - msg.push_s, now)
        handles = []
        for gid in gids:
            g = self.groups.pop(gid)
            for tid in g.members:
                t = self.trajs.pop(tid)
                handles.append(t.handle)
        self.free(handles)
        self.version = msg.version
        self.coord.on_new_version(msg.version)
        self.log_step(v_trained, msg)
        every = self.cfg.checkpoint.every
        if every and self.version % every == 0 and self.version < self.cfg.steps:
            self.save(export=False)

    def log_step(self, v_trained: int, msg: StepDone) -> None:
        now = time.monotonic()
        tokens = sum(self.tokens_generated.values())
        t_prev, tok_prev, n_prev = self._last_log
        rewards = self.step_acc.pop("reward", [])
        stale = self.step_acc.pop("staleness", [])
        lens = self.step_acc.pop("response_len", [])
        trained_tokens = sum(self.step_acc.pop("trained_tokens", []))
        dt = max(now - t_prev, 1e-6)
        self.counts["samples"] += len(rewards)
        hist = Counter(stale)
        metrics = {
            "reward_mean": sum(rewards) / max(len(rewards), 1),
            "accuracy": sum(r > 0.5 for r in rewards) / max(len(rewards), 1),
            "tokens_per_s": (tokens - tok_prev) / dt,
            "samples_per_s": (self.counts["samples"] - n_prev) / dt,
            "response_len_mean": sum(lens) / max(len(lens), 1),
            "staleness_mean": sum(stale) / max(len(stale), 1),
            "staleness_max": max(stale, default=0),
            "staleness_hist": {str(k): n for k, n in sorted(hist.items())},
            "bound_violations": self.bound_violations,
            "trained_groups": len(stale),
            "trained_trajectories": len(rewards),
            "trained_tokens": trained_tokens,
            "train_s": msg.train_s, "push_s": msg.push_s,
            "pulls": self.counts["pulls"], "interrupts": self.counts["interrupts"],
            "migrations": self.counts["migrations"], "routes": self.counts["routes"],
            "groups_aborted": self.counts["groups_aborted"],
            "train": msg.metrics,
        }
        self._last_log = (now, tokens, self.counts["samples"])
        self.writer.log_step(v_trained, metrics)
        self.progress.update(msg.version, metrics)

    # ---- checkpoints -------------------------------------------------------------------------
    def resume_state(self) -> dict:
        live = [dataclasses.asdict(g.prompt) for g in self.groups.values()]
        return {"version": self.version, "data": self.source.state_dict(), "requeue": live,
                "counts": dict(self.counts), "next_group": self.next_group, "next_traj": self.next_traj}

    def _restore(self, extra: dict) -> None:
        from staleflow.data import Prompt

        self.source.load_state_dict(extra["data"])
        self.counts.update(extra.get("counts", {}))
        self.next_group, self.next_traj = extra.get("next_group", 0), extra.get("next_traj", 0)
        for p in extra.get("requeue", []):  # in flight at the checkpoint: generated again from scratch
            self.submit_group(Prompt(**p))

    def save(self, export: bool) -> None:
        t0 = time.time()
        export_dir = os.path.join(self.run_dir, "hf") if export else ""
        self.ctl.broadcast(SaveState(step=self.version, extra=self.resume_state(), export_dir=export_dir),
                           ranks=self.ctl.roles.trainer_ranks)
        while True:
            got = self.ctl.recv(600)
            if got is None:
                raise RuntimeError("the trainer did not finish saving the checkpoint within 600 s")
            rank, msg = got
            if isinstance(msg, Saved):
                break
            if isinstance(msg, InstanceStats):
                self.tokens_generated[msg.instance] = msg.tokens_generated
            elif isinstance(msg, TrajDone):
                self.on_traj_done(rank, msg)
            elif isinstance(msg, Pulled):
                self.on_pulled(rank, msg)
        self.writer.log_span(0, "checkpoint", t0, time.time())

    def emergency_save(self, err: RankDied) -> None:
        """A rollout rank died: finish the running step and save a resumable checkpoint before stopping."""
        self.ctl.left.add(err.rank)
        self.ctl.grace_s = 20.0  # torchrun's SIGTERM to the survivors follows the death; finish the save
        print(f"staleflow: {err}; saving a checkpoint before stopping", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 600
        while self.trainer_busy is not None and time.monotonic() < deadline:
            got = self.ctl.recv(1.0)
            if got is not None and isinstance(got[1], StepDone):
                self.on_step_done(got[1])
        self.save(export=False)
        print(f"staleflow: resume with --resume {self.run_dir}", file=sys.stderr, flush=True)

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except RankDied as e:
            if e.rank is not None and self.ctl.roles.role(e.rank) == "rollout":
                self.emergency_save(e)
            raise
        finally:
            self.rewards.close()
            self.progress.close()
            self.writer.close()
            for r in self.rings.values():
                r.close()

    def _run(self) -> None:
        if self.version > 0:  # resumed: every instance loads the trainer's weights first
            for inst in self.rank_of:
                self.execute(Pull(instance=inst, version=self.version))
        tick = self.coord_cfg.tick_ms / 1000.0
        next_tick = time.monotonic()
        while self.version < self.cfg.steps:
            self.refill()
            got = self.ctl.recv(max(0.0, min(tick, next_tick - time.monotonic())))
            while got is not None:
                self.handle(*got)
                got = self.ctl.recv(0.0)
            for key, reward, _info in self.rewards.poll():
                self.on_reward(key, reward)
            now = time.monotonic()
            if now >= next_tick:
                for cmd in self.coord.tick(now):
                    self.execute(cmd)
                next_tick = now + tick
            self.maybe_train()
        self.save(export=self.cfg.checkpoint.export_hf)
        self.wrap_up()

    def wrap_up(self) -> None:
        self.progress.close()
        if self.cfg.log.plot:
            from staleflow.metrics.report import make_report

            make_report(self.run_dir)
        print(f"[controller] run folder: {self.run_dir}", flush=True)
