"""Stand-ins for the controller loop's collaborators in tests: a backend that records every command
and replays the events a test pushes, and a fixed workload."""

from __future__ import annotations

from collections import deque

from staleflow.controller import Rewarded


class ScriptedBackend:
    """Records every command; the test pushes the events the ranks would send.

    reward: None = rewards are the test's to deliver (scored ids are recorded); a number = every
    scored trajectory is rewarded with it at once."""

    def __init__(self, reward: float | None = None):
        self.t = 0.0
        self.reward = reward
        self.events: deque = deque()
        self.sent: list = []
        self.freed: list = []
        self.scored: list[int] = []
        self.trained: list = []

    def now(self):
        return self.t

    def poll(self, until):
        self.t = max(self.t, until)
        while self.events:
            yield self.events.popleft()

    def route(self, cmd):
        self.sent.append(cmd)

    def interrupt(self, cmd):
        self.sent.append(cmd)

    def abort(self, cmd):
        self.sent.append(cmd)

    def pull(self, cmd):
        self.sent.append(cmd)

    def free(self, handles):
        self.freed.extend(handles)

    def score(self, traj_id, handle, prompt):
        self.scored.append(traj_id)
        if self.reward is not None:
            self.events.append(Rewarded(traj_id, self.reward))

    def train(self, version, batch):
        self.trained.append((version, batch))


class Prompts:
    def next_prompt(self):
        return "prompt"

    def prompt_len(self, prompt):
        return 10

    def env_fields(self, prompt):
        return {}

    def prompt_ids(self, prompt):
        return list(range(10))

    def new_member(self):
        return 0, 0
