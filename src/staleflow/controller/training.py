"""What the trainer gets, in the controller loop: the groups that occupy a slot (DAPO refill decides which
all-equal groups are replaced instead), and a Ready buffer consumed into the step's TrainGroups.

DAPO dynamic sampling with refill (``--train.dynamic-sampling-refill K``). A group whose N rewards are all
equal has zero advantage everywhere and teaches nothing. Up to K such groups per trainer version are
aborted at the moment they would occupy their slot, exactly as a group whose window closed: the protocol
releases the reservation, the loop frees the records (the coordinator's Abort commands), and the loop's
queue refill admits a fresh prompt group, a new trajectory reserved, generated, rewarded and occupied
under the same rules as any other (the staleness bound holds for it like for every trained group). Past
K the group occupies its slot and the trainer's filter (``--train.dynamic-sampling``) drops it, so a
policy that solves nothing or everything cannot stall the run. Decided on the raw rewards (DAPO filters
on accuracy).

Consume. The buffer's groups in group-id order, members by id: the batch does not depend on finishing
order (which the OS scheduler decides), so a synchronous run is reproducible; each trained group is
audited (its bound, completeness) and its surplus members' records are freed.
"""

from __future__ import annotations

from collections import Counter

from staleflow.trajectory import TrainGroup


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


def consume(v: int, manager, ledger, audit, workload, free) -> tuple[list[TrainGroup], list[int], dict, dict]:
    """Consume Ready buffer ``v``: (its TrainGroups, each group's staleness, a sample text and the prompt per
    group). ``free(handles)`` releases the surplus members' records."""
    spec = manager.spec
    batch, stale, samples, prompts = [], [], {}, {}
    for gid in sorted(manager.consume(v)):
        g, trained, surplus = ledger.consume(gid)
        trained.sort(key=lambda t: t.traj_id)
        free([t.handle for t in surplus])
        V = min(t.traj_version for t in trained)
        complete = len(trained) == spec.group_size and all(t.reward is not None for t in trained)
        audit.trained(gid, V, v, spec.eta, manager.bounded, complete, len(trained))
        stale.append(v - V)
        samples[gid], prompts[gid] = trained[0].text, g.prompt
        batch.append(
            TrainGroup(
                gid,
                V,
                [t.traj_id for t in trained],
                [t.handle for t in trained],
                [float(t.reward) for t in trained],
                [t.n_tokens for t in trained],
                workload.prompt_len(g.prompt),
            )
        )
    return batch, stale, samples, prompts
