"""The ledger: the one table of trajectories and prompt groups the controller keeps.

Pure bookkeeping (no torch, no I/O), shared by the real runtime and the simulator. For every
trajectory it holds what the controller knows and nobody else owns: the group it belongs to,
its prompt length and sampling seed, its newest record handle (partial while interrupted, final
once finished) and the tokens generated so far, the instance it was last interrupted on, its
V_traj, reward and fate. The protocol keeps buffer reservations (which buffer a group holds, which
member ids hold it) and the Coordinator the scheduling state (the queue, which ids run on which
instance); both refer to trajectories by id only. The Coordinator looks the facts it acts on
(group, V_traj, lengths, origin) up here by id: controller/build.py gives it ``Ledger.trajs``
(``coordinator.types.TrajFacts`` names what it reads). Only the loop writes the table.

Fates. A trajectory is live from submission until it ends exactly once, as ``consumed``
(trained) or ``aborted: <reason>``; ``ended`` keeps every fate so an audit can prove nothing was
trained twice or lost. A group is live until consumed or aborted with all its members.

    ledger = Ledger()
    g = ledger.new_group(prompt, seeds=[...], target_lens=[...], prompt_len=40)   # N' member trajectories
    ledger.accept_finish(tid, handle, n_tokens)                     # generation over
    ledger.set_reward(tid, 1.0)
    ledger.rewarded_members(gid, n)                                 # the N trajectories to occupy with
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from staleflow.trajectory import TurnStats


@dataclass
class Traj:
    traj_id: int
    group_id: int
    seed: int
    target_len: int = 0
    """Benchmark/simulated workloads: the drawn response length (0: the model decides)."""
    handle: Any = None
    """Newest record of its tokens (a servers.RecordHandle in the runtime; a simulated one in the simulator)."""
    traj_version: int | None = None
    """V_traj, written once, at its first route (None: never routed)."""
    n_tokens: int = 0
    """Tokens generated: so far while interrupted (its partial record), all of them once finished."""
    prompt_len: int = 0
    origin: int = -1
    """The instance it was last interrupted on (-1: never interrupted); it resumes there without migration."""
    finished: bool = False
    """Generation is over and the coordinator counted it (one of the group's N)."""
    truncate: bool = False
    """A straggler being truncated: its next partial record is final."""
    reward: float | None = None
    reward_error: str = ""
    text: str = ""
    turns: TurnStats | None = None
    """Multi-turn: its turns and tool calls (the newest Finished's) and tool seconds summed over every instance
    it ran on (None: single-turn)."""

    @property
    def tokens(self) -> int:
        """KV tokens it brings to an instance: prompt + generated so far (the coordinator's TrajFacts)."""
        return self.prompt_len + self.n_tokens


@dataclass
class Group:
    group_id: int
    prompt: Any
    members: list[int] = field(default_factory=list)
    """Live member ids (submission order)."""
    finished: list[int] = field(default_factory=list)
    """Members whose finish the coordinator accepted, in finishing order (at most N)."""
    occupied: bool = False
    """Its N members occupy a buffer slot (which buffer is the protocol's)."""


class LedgerError(RuntimeError):
    """An id the ledger does not hold, or a fate assigned twice."""


class Ledger:
    def __init__(self, next_traj: int = 0, next_group: int = 0):
        self.trajs: dict[int, Traj] = {}
        self.groups: dict[int, Group] = {}
        self.next_traj, self.next_group = next_traj, next_group
        """High-water marks: ids are never reused, also across a resume (they are checkpointed)."""
        self.ended: dict[int, str] = {}
        """traj_id -> "consumed" | "aborted: <reason>", for every trajectory that ended."""

    # ---- creation ----------------------------------------------------------------------------
    def new_group(self, prompt, seeds: list[int], target_lens: list[int] | None = None, prompt_len: int = 0) -> Group:
        gid, self.next_group = self.next_group, self.next_group + 1
        g = self.groups[gid] = Group(gid, prompt)
        for i, seed in enumerate(seeds):
            tid, self.next_traj = self.next_traj, self.next_traj + 1
            self.trajs[tid] = Traj(tid, gid, seed, target_lens[i] if target_lens else 0, prompt_len=prompt_len)
            g.members.append(tid)
        return g

    # ---- queries -----------------------------------------------------------------------------
    def get(self, traj_id: int) -> Traj | None:
        return self.trajs.get(traj_id)

    def group_of(self, traj_id: int) -> Group:
        return self.groups[self.trajs[traj_id].group_id]

    def rewarded_members(self, group_id: int, group_size: int) -> list[Traj] | None:
        """The group's N accepted finishers if all of them are rewarded, else None."""
        g = self.groups.get(group_id)
        if g is None or g.occupied or len(g.finished) < group_size:
            return None
        done = [self.trajs[t] for t in g.finished]
        return done if all(t.reward is not None for t in done) else None

    # ---- transitions -------------------------------------------------------------------------
    def set_handle(self, traj_id: int, handle) -> Any:
        """Record a newer record of the trajectory; returns the superseded handle (to free), if any."""
        t = self.trajs[traj_id]
        old, t.handle = t.handle, handle
        return old if old is not None and old != handle else None

    def accept_finish(self, traj_id: int, n_tokens: int) -> Traj:
        t = self.trajs[traj_id]
        if t.finished:
            raise LedgerError(f"trajectory {traj_id} finished twice")
        t.finished, t.n_tokens = True, n_tokens
        self.groups[t.group_id].finished.append(traj_id)
        return t

    def set_reward(self, traj_id: int, reward: float, error: str = "") -> Traj | None:
        t = self.trajs.get(traj_id)
        if t is not None:
            t.reward, t.reward_error = reward, error
        return t

    def _end(self, traj_id: int, fate: str) -> Traj:
        t = self.trajs.pop(traj_id, None)
        if t is None:
            raise LedgerError(f"trajectory {traj_id} is not live (ended: {self.ended.get(traj_id, 'never existed')})")
        self.ended[traj_id] = fate
        return t

    def drop(self, traj_id: int, reason: str) -> Traj | None:
        """End one live trajectory as aborted; returns it (its handle is the caller's to free) or None."""
        if traj_id not in self.trajs:
            return None
        t = self._end(traj_id, f"aborted: {reason}")
        g = self.groups.get(t.group_id)
        if g is not None:
            g.members.remove(traj_id)
            if traj_id in g.finished:
                g.finished.remove(traj_id)
        return t

    def drop_group(self, group_id: int, reason: str) -> tuple[Group | None, list[Traj]]:
        """End a group and every live member as aborted; returns (group, dropped members)."""
        g = self.groups.pop(group_id, None)
        if g is None:
            return None, []
        dropped = [self._end(t, f"aborted: {reason}") for t in list(g.members)]
        g.members.clear()
        return g, dropped

    def occupy(self, group_id: int) -> None:
        self.groups[group_id].occupied = True

    def consume(self, group_id: int) -> tuple[Group, list[Traj], list[Traj]]:
        """End a trained group: (group, its consumed finishers, other members aborted as surplus)."""
        g = self.groups.pop(group_id)
        trained = [self._end(t, "consumed") for t in g.finished]
        surplus = [self._end(t, "aborted: surplus") for t in g.members if t in self.trajs]
        g.members.clear()
        return g, trained, surplus

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resume needs: id high-water marks and the prompts of live groups (regenerated)."""
        return {
            "next_traj": self.next_traj,
            "next_group": self.next_group,
            "live_prompts": [g.prompt for g in self.groups.values()],
        }
