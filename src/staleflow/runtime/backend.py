"""The controller loop's Backend for the real system: ranks over ZeroMQ, rings, the reward pool;
and its Workload: prompts from the dataset.

Commands leave as messages to the rank that runs the instance (the Route, completed by the loop
with the prompt, Interrupt, Abort and Pull, all as they are); ranks answer with Finished,
InstanceSnapshot, Pulled and StepDone, which are (or become) the loop's events. Finished responses
are read from the rollout rank's ring, decoded and scored in the reward pool. The timeline
(generate / pull / train spans per rank) is written here, where the times are known.

In a multi-node run a rollout rank on another node ships its finished records to this node's
mirror of its ring (servers/mirror.py); a record announced before its bytes arrived is scored
once they do (checked at every poll, never waited for). ``traffic_row`` adds the cross-node
counters and each instance's pull times to the step's metrics row.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict

from staleflow.config import parse_length_dist
from staleflow.control.messages import Evaluated, FreeRecords, Pulled, Saved, StepDone, TrainStep
from staleflow.controller.backend import Published, PullDone, Rewarded, TrainDone
from staleflow.coordinator.types import Abort, InstanceSnapshot, Interrupt, Pull
from staleflow.servers import StaleHandle, TrajectoryRing
from staleflow.servers.mirror import RecordLate, arrived, attach_mirror, read_arrived
from staleflow.trajectory import Finished, RecordHandle, Route, TrainGroup
from staleflow.workers.turns import final_turn_ids

RECORD_WAIT_S = 120.0


class RuntimeBackend:
    def __init__(self, ctl, cfg, tokenizer, rewards, writer):
        self.ctl, self.cfg, self.tokenizer, self.rewards, self.writer = ctl, cfg, tokenizer, rewards, writer
        roles = ctl.roles
        self.rank_of = {roles.instance_id(r): r for r in roles.rollout_ranks}
        topo = ctl.topology
        self.mirrored = {r for r in roles.rollout_ranks if topo is not None and not topo.same_node(r, 0)}
        self.rings = {
            r: attach_mirror(ctl.run_id, r, topo.home, timeout=60)
            if r in self.mirrored
            else TrajectoryRing.attach(ctl.run_id, r, timeout=30)
            for r in roles.rollout_ranks
        }
        self._unscored: list[tuple[int, RecordHandle, object, float]] = []  # still on the way from another node
        self.traffic = {
            "cross_node_records": 0,
            "cross_node_record_bytes": 0,
            "cross_node_pull_bytes": 0,
            "cross_node_partial_fetches": 0,
        }
        self.pulled_from: dict[int, int] = {}
        """Weight bytes every pull took from each node (run totals: its Parameter Server pieces' egress)."""
        self._pull_times: dict[int, list[float]] = defaultdict(list)
        self._texts: dict[int, str] = {}  # decoded responses being scored: they ride on their Rewarded
        self._gen_since: dict[int, float | None] = {i: None for i in self.rank_of}
        self._pull_since: dict[int, float] = {}
        self._train_sent = 0.0

    def now(self) -> float:
        return time.monotonic()

    # ---- commands ----------------------------------------------------------------------------
    def route(self, cmd: Route) -> None:
        self.ctl.send(self.rank_of[cmd.instance], cmd)

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

    def read(self, handle: RecordHandle):
        """A record's payload (TrajectoryTokens); a mirrored rank's once it reached this node (held-out answers)."""
        ring = self.rings[handle.rank]
        return read_arrived(ring, handle, RECORD_WAIT_S) if handle.rank in self.mirrored else ring.read(handle)

    def score(self, traj_id: int, handle: RecordHandle, prompt) -> None:
        if handle.rank in self.mirrored and not arrived(self.rings[handle.rank], handle):
            self._unscored.append((traj_id, handle, prompt, time.monotonic() + RECORD_WAIT_S))
            return
        rec = self.rings[handle.rank].read(handle)
        text = self.tokenizer.decode(final_turn_ids(rec), skip_special_tokens=True)  # multi-turn: the last turn
        self._texts[traj_id] = text
        self.rewards.submit(traj_id, text, prompt.answer, dict(prompt.meta), prompt=prompt.text)

    def _score_arrived(self):
        """Score the mirrored records that arrived since; a record freed before it could be scored
        belongs to a trajectory dropped meanwhile (its reward is then ignored by the loop)."""
        waiting, self._unscored = self._unscored, []
        for traj_id, handle, prompt, deadline in waiting:
            if not arrived(self.rings[handle.rank], handle):
                if time.monotonic() > deadline:
                    raise RecordLate(
                        f"the record of trajectory {traj_id} ({handle}) announced by rank {handle.rank} "
                        f"did not reach this node within {RECORD_WAIT_S:.0f} s: is the record receiver "
                        f"(trainer rank 0) alive and the network between the nodes up?"
                    )
                self._unscored.append((traj_id, handle, prompt, deadline))
                continue
            try:
                self.score(traj_id, handle, prompt)
            except StaleHandle as e:
                yield Rewarded(traj_id, 0.0, f"StaleHandle: {e}")

    def train(self, version: int, batch: list[TrainGroup]) -> None:
        self._train_sent = time.time()
        self.ctl.broadcast(TrainStep(version=version, groups=batch), ranks=self.ctl.roles.trainer_ranks)

    # ---- events ------------------------------------------------------------------------------
    def poll(self, until: float):
        """Messages that arrive until `until` (returning early once some arrived) and finished rewards."""
        got = self.ctl.recv(max(0.0, until - time.monotonic()))
        while got is not None:
            yield from self.events_of(*got)
            got = self.ctl.recv(0.0)
        if self._unscored:
            yield from self._score_arrived()
        for key, reward, info in self.rewards.poll():
            yield Rewarded(key, float(reward), str(info.get("error") or ""), self._texts.pop(key, ""))

    def events_of(self, rank: int, msg):
        """The loop events of one rank message (a checkpoint's Saved and a held-out answer's Evaluated
        go to the training job's listeners)."""
        if isinstance(msg, InstanceSnapshot):
            self._on_snapshot(rank, msg)
            yield msg
        elif isinstance(msg, Finished):
            self.traffic["cross_node_records"] += msg.cross_node_copies
            self.traffic["cross_node_record_bytes"] += msg.cross_node_bytes
            self.traffic["cross_node_partial_fetches"] += msg.fetched
            yield msg
        elif isinstance(msg, Pulled):
            t0 = self._pull_since.pop(msg.instance, time.time() - msg.seconds)
            self.writer.log_span(
                rank, "pull", t0, time.time(), version=msg.version, nbytes=msg.nbytes, cross_node=msg.cross_node
            )
            self._pull_times[msg.instance].append(msg.seconds)
            self.traffic["cross_node_pull_bytes"] += msg.cross_node_bytes
            for node, nbytes in msg.by_node.items():  # what each node's Parameter Server pieces sent
                self.pulled_from[node] = self.pulled_from.get(node, 0) + nbytes
            yield PullDone(msg.instance, msg.version, msg.seconds)
        elif isinstance(msg, StepDone):
            now = time.time()
            self.writer.log_span(0, "train", self._train_sent, now - msg.push_s)
            self.writer.log_span(0, "push", now - msg.push_s, now)
            yield TrainDone(msg.version, msg.metrics, msg.train_s, msg.push_s, msg.content, msg.token_versions)
            yield Published(msg.version)
        elif isinstance(msg, (Saved, Evaluated)):
            yield msg
        else:
            raise RuntimeError(f"unexpected message {type(msg).__name__} from rank {rank}")

    def _on_snapshot(self, rank: int, msg: InstanceSnapshot) -> None:
        busy = msg.running + msg.waiting > 0
        since = self._gen_since[msg.instance]
        if busy and since is None:
            self._gen_since[msg.instance] = time.time()
        elif not busy and since is not None:
            self.writer.log_span(rank, "generate", since, time.time())
            self._gen_since[msg.instance] = None

    def traffic_row(self) -> dict:
        """Run totals of cross-node traffic, and each instance's mean pull time since the last row."""
        row = dict(self.traffic)
        row["pull_bytes_by_node"] = {str(n): b for n, b in sorted(self.pulled_from.items())}
        row["pull_s_by_instance"] = {str(i): sum(ts) / len(ts) for i, ts in sorted(self._pull_times.items()) if ts}
        self._pull_times.clear()
        return row

    def close(self) -> None:
        t = self.traffic
        topo = self.ctl.topology
        if topo is not None and topo.multi_node:
            by_node = ", ".join(f"node {n}: {b / 1e6:.1f} MB" for n, b in sorted(self.pulled_from.items()))
            print(
                f"[controller] cross-node traffic: {t['cross_node_records']} records "
                f"({t['cross_node_record_bytes'] / 1e6:.2f} MB), {t['cross_node_pull_bytes'] / 1e6:.1f} MB of "
                f"weights pulled across nodes; weights pulled from each node's Parameter Server pieces: {by_node or 'none'}",
                flush=True,
            )
        for r in self.rings.values():
            r.close()


class RuntimeWorkload:
    """Prompts from the dataset; a seed per trajectory; lengths drawn only for benchmark workloads."""

    def __init__(self, cfg, source):
        self.source, self.rng = source, random.Random(cfg.seed)
        self.length_dist = parse_length_dist(cfg.rollout.length_dist) if cfg.rollout.length_dist else None
        self.max_new_tokens = cfg.rollout.max_new_tokens
        self.with_env = bool(cfg.env.name)
        self.submitted: dict[int, float] = {}
        """prompt id -> when the loop drew it (seconds since the epoch), until its group is trained."""

    def next_prompt(self):
        p = next(self.source)
        self.submitted[p.prompt_id] = time.time()  # trained.jsonl's submitted_s (popped when trained)
        return p

    def prompt_len(self, prompt) -> int:
        return len(prompt.prompt_ids)

    def prompt_ids(self, prompt) -> list[int]:
        return list(prompt.prompt_ids)

    def env_fields(self, prompt) -> dict:
        """The row's answer and meta ride on the Route only when an environment resets from them."""
        return {"answer": prompt.answer, "meta": dict(prompt.meta)} if self.with_env else {}

    def new_member(self) -> tuple[int, int]:
        seed = self.rng.getrandbits(62)
        if not self.length_dist:
            return seed, 0
        median, sigma = self.length_dist
        return seed, max(1, min(self.max_new_tokens, int(round(self.rng.lognormvariate(math.log(median), sigma)))))
