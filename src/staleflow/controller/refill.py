"""DAPO dynamic sampling with refill, in the controller loop (``--train.dynamic-sampling-refill K``).

A group whose N rewards are all equal has zero advantage everywhere and teaches nothing. Up to K
such groups per trainer version are aborted at the moment they would occupy their slot, exactly
as a group whose window closed: the protocol releases the reservation, the loop frees the records
(the coordinator's Abort commands), and the loop's queue refill admits a fresh prompt group, a new
trajectory reserved, generated, rewarded and occupied under the same rules as any other (the
staleness bound holds for it like for every trained group). Past K the group occupies its slot
and the trainer's filter (``--train.dynamic-sampling``) drops it, so a policy that solves nothing
or everything cannot stall the run. Decided on the raw rewards (DAPO filters on accuracy).
"""

from __future__ import annotations

from collections import Counter


class Refill:
    def __init__(self, budget: int, coordinator, counts: Counter):
        self.budget, self.coord, self.counts = budget, coordinator, counts
        self.used: Counter = Counter()
        """Groups replaced, per trainer version."""

    def replaces(self, group_id: int, members, version: int) -> bool:
        """True when the group (its rewarded members) is aborted for a fresh one instead of occupying."""
        if not self.budget or self.used[version] >= self.budget:
            return False
        if len({t.reward for t in members}) > 1:
            return False
        self.used[version] += 1
        self.counts["groups_refilled"] += 1
        self.coord.abort_group(group_id, "no-signal", self.coord.clock())
        return True
