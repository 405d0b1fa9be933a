"""The controller loop's Backend for the real system: ranks over ZeroMQ, rings, the reward pool.

Commands leave as messages to the rank that runs the instance (the coordinator's Route inside a
RouteTraj with the prompt; Interrupt, Abort and Pull as they are); ranks answer with TrajDone,
InstanceSnapshot, Pulled and StepDone, which become the loop's events. Finished responses are
read from the rollout rank's ring, decoded and scored in the reward pool. The timeline
(generate / pull / train spans per rank) is written here, where the times are known.
"""

from __future__ import annotations

import time
from collections import defaultdict

from staleflow.controller.backend import Finished, PullDone, Published, Rewarded, TrainDone, TrainGroup
from staleflow.coordinator.types import Abort, InstanceSnapshot, Interrupt, Pull, Route
from staleflow.launch.messages import (Evaluated, FreeRecords, Pulled, RouteTraj, Saved, StepDone, TrainItem,
                                       TrainStep, TrajDone)
from staleflow.servers import RecordHandle, TrajectoryRing


class RuntimeBackend:
    def __init__(self, ctl, cfg, tokenizer, rewards, writer):
        self.ctl, self.cfg, self.tokenizer, self.rewards, self.writer = ctl, cfg, tokenizer, rewards, writer
        roles = ctl.roles
        self.rank_of = {roles.instance_id(r): r for r in roles.rollout_ranks}
        self.rings = {r: TrajectoryRing.attach(ctl.run_id, r, timeout=30) for r in roles.rollout_ranks}
        self.texts: dict[int, str] = {}
        """Decoded responses of scored trajectories (trained.jsonl shows one per group)."""
        self.tokens_generated: dict[int, int] = {}
        self.saved: Saved | None = None
        self.evaluated: list[Evaluated] = []
        """Held-out answers (launch/evaluation.py), taken by the training job: not loop events."""
        self._gen_since: dict[int, float | None] = {i: None for i in self.rank_of}
        self._pull_since: dict[int, float] = {}
        self._train_sent = 0.0

    def now(self) -> float:
        return time.monotonic()

    # ---- commands ----------------------------------------------------------------------------
    def route(self, cmd: Route, prompt, seed: int, partial, target_len: int) -> None:
        self.ctl.send(self.rank_of[cmd.instance], RouteTraj(
            route=cmd, prompt_ids=list(prompt.prompt_ids), seed=seed, partial=partial,
            max_new_tokens=target_len))

    def interrupt(self, cmd: Interrupt) -> None:
        self.ctl.send(self.rank_of[cmd.instance], cmd)

    def abort(self, cmd: Abort) -> None:
        self.ctl.send(self.rank_of[cmd.instance], cmd)

    def pull(self, cmd: Pull) -> None:
        self._pull_since[cmd.instance] = time.time()
        self.ctl.send(self.rank_of[cmd.instance], cmd)

    def free(self, handles: list) -> None:
        by_rank = defaultdict(list)
        for h in handles:
            by_rank[h.rank].append(h)
        for rank, hs in by_rank.items():
            self.ctl.send(rank, FreeRecords(handles=hs))

    def score(self, traj_id: int, handle: RecordHandle, prompt) -> None:
        rec = self.rings[handle.rank].read(handle)
        text = self.tokenizer.decode(rec.response_ids.tolist(), skip_special_tokens=True)
        self.texts[traj_id] = text
        self.rewards.submit(traj_id, text, prompt.answer, dict(prompt.meta))

    def train(self, version: int, batch: list[TrainGroup]) -> None:
        items = [TrainItem(handle=h, reward=r, group_id=g.group_id, traj_version=g.traj_version)
                 for g in batch for h, r in zip(g.handles, g.rewards)]
        self._train_sent = time.time()
        self.ctl.broadcast(TrainStep(version=version, items=items), ranks=self.ctl.roles.trainer_ranks)

    # ---- events ------------------------------------------------------------------------------
    def poll(self, until: float):
        """Messages that arrive until `until` (returning early once some arrived) and finished rewards."""
        got = self.ctl.recv(max(0.0, until - time.monotonic()))
        while got is not None:
            yield from self.events_of(*got)
            got = self.ctl.recv(0.0)
        for key, reward, info in self.rewards.poll():
            yield Rewarded(key, float(reward), str(info.get("error") or ""))

    def events_of(self, rank: int, msg):
        """The loop events of one rank message (a Saved only sets self.saved)."""
        if isinstance(msg, InstanceSnapshot):
            self._on_snapshot(rank, msg)
            yield msg
        elif isinstance(msg, TrajDone):
            yield Finished(msg.traj_id, msg.instance, msg.handle, msg.n_tokens, msg.partial)
        elif isinstance(msg, Pulled):
            t0 = self._pull_since.pop(msg.instance, time.time() - msg.seconds)
            self.writer.log_span(rank, "pull", t0, time.time(), version=msg.version)
            yield PullDone(msg.instance, msg.version, msg.seconds)
        elif isinstance(msg, StepDone):
            now = time.time()
            self.writer.log_span(0, "train", self._train_sent, now - msg.push_s)
            self.writer.log_span(0, "push", now - msg.push_s, now)
            yield TrainDone(msg.version, msg.metrics, msg.train_s, msg.push_s)
            yield Published(msg.version)
        elif isinstance(msg, Saved):
            self.saved = msg
        elif isinstance(msg, Evaluated):
            self.evaluated.append(msg)
        else:
            raise RuntimeError(f"unexpected message {type(msg).__name__} from rank {rank}")

    def _on_snapshot(self, rank: int, msg: InstanceSnapshot) -> None:
        self.tokens_generated[msg.instance] = msg.tokens_generated
        busy = msg.running + msg.waiting > 0
        since = self._gen_since[msg.instance]
        if busy and since is None:
            self._gen_since[msg.instance] = time.time()
        elif not busy and since is not None:
            self.writer.log_span(rank, "generate", since, time.time())
            self._gen_since[msg.instance] = None

    def close(self) -> None:
        for r in self.rings.values():
            r.close()
