"""What the trainer consumes: a Ready buffer's TrainGroups with their members' token payloads, and the
packed MicroBatch tensors it makes of them.

The runtime hands `Trainer.step` the groups of one Ready staleness buffer (``TrainGroup``: rewards,
V_traj, member ids) and, per group, its members' ``TrajectoryTokens`` read back from the rings, in
``traj_ids`` order. `step_payloads` checks and flattens them: member k of the step is the k-th payload,
group after group, the index of every per-trajectory list of the step (rewards, advantages, weights).
The trainer packs each micro-batch's sequences (prompt + response, end to end, no padding) into a
MicroBatch:

    input_ids, positions  [T]       the packed token stream and per-sequence positions
    cu_seqlens            [B + 1]   sequence boundaries (for PackedAttention)
    rows                  [N]       indices into [T] of the hidden states that predict a
                                    model-sampled response token (the last prompt token .. the
                                    second-to-last response token of each sequence, less those
                                    predicting an environment token: loss_mask 0)
    targets               [N]       the response tokens those rows predict
    behaviour_logp, advantages, token_weight, versions, seq_index   [N]

Only the N rows go through the LM head, so prompt and environment tokens cost no vocab projection
and are outside the loss and the off-policy ratios; they stay in input_ids as context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from staleflow.trajectory import TrainGroup, TrajectoryTokens


def step_payloads(
    groups: Sequence[TrainGroup], payloads: Sequence[Sequence[TrajectoryTokens]]
) -> list[TrajectoryTokens]:
    """The step's payloads flattened, group after group, each member's in ``traj_ids`` order, after
    checking them: one payload list per group, one payload per member, each payload consistent and each
    reward finite. A bad one raises a one-line ValueError naming the group and the member
    (``group 3 member 1 (trajectory 13): 1 behaviour_logprobs for 2 response tokens: ...``).
    """
    if len(payloads) != len(groups):
        raise ValueError(
            f"{len(payloads)} payload lists for {len(groups)} groups: pass one list per TrainGroup, in the same order"
        )
    out = []
    for g, members in zip(groups, payloads):
        n = len(g.rewards)
        if len(members) != n or len(g.traj_ids) != n:
            raise ValueError(
                f"group {g.group_id}: {len(members)} payloads and {len(g.traj_ids)} traj_ids for {n} rewards: "
                "pass one payload per member, in traj_ids order"
            )
        for j, (tokens, reward) in enumerate(zip(members, g.rewards)):
            what = f"group {g.group_id} member {j} (trajectory {g.traj_ids[j]})"
            tokens.validate(what)
            if not math.isfinite(float(reward)):
                raise ValueError(f"{what}: reward={reward!r} is not a finite number")
            out.append(tokens)
    return out


def member_groups(groups: Sequence[TrainGroup]) -> list[int]:
    """The group id of each member of the step, in `step_payloads` order."""
    return [g.group_id for g in groups for _ in g.rewards]


@dataclass
class MicroBatch:
    """Packed tensors of one micro-batch (see the module docstring)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor
    behaviour_logp: torch.Tensor
    advantages: torch.Tensor
    token_weight: torch.Tensor
    versions: torch.Tensor
    seq_index: torch.Tensor
    sample_ids: list[int]
    """Indices (into the step's payloads, `step_payloads`' order) of the packed sequences, in packing order."""

    @property
    def num_seqs(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device) -> MicroBatch:
        kw = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return MicroBatch(**kw)


def build_micro_batch(
    payloads: Sequence[TrajectoryTokens], ids: Sequence[int], advantages: Sequence[float], seq_weights: Sequence[float]
) -> MicroBatch:
    """Pack payloads[ids] (each with >= 1 response token) into one MicroBatch.

    advantages and seq_weights are indexed like `payloads` (one per trajectory: `step_payloads`' order). An empty `ids`
    gives a one-token dummy micro-batch with no response rows: ranks with less data run it so
    that every rank performs the same number of FSDP forward/backward passes.
    """
    if not ids:
        one = torch.zeros(1, dtype=torch.int64)
        none_i, none_f = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
        return MicroBatch(
            one,
            one.clone(),
            torch.tensor([0, 1], dtype=torch.int32),
            none_i,
            none_i.clone(),
            none_f,
            none_f.clone(),
            none_f.clone(),
            none_i.clone(),
            none_i.clone(),
            [],
        )
    tokens: list[int] = []
    positions: list[int] = []
    cu = [0]
    rows: list[int] = []
    targets: list[int] = []
    beh: list[float] = []
    adv: list[float] = []
    wts: list[float] = []
    vers: list[int] = []
    seg: list[int] = []
    for j, i in enumerate(ids):
        t = payloads[i]
        p, r = list(t.prompt_ids), list(t.response_ids)
        if not r:
            raise ValueError(f"trajectory {i} of the step has no response tokens: zero-length responses are not packed")
        start = cu[-1]
        tokens += p + r
        positions += range(len(p) + len(r))
        cu.append(start + len(p) + len(r))
        if t.loss_mask is None:  # every response token is the model's
            rows += range(start + len(p) - 1, start + len(p) + len(r) - 1)
            targets += r
            beh += [float(x) for x in t.behaviour_logprobs]
            vers += [int(v) for v in t.versions]
            n = len(r)
        else:  # only the model's tokens become rows
            keep = [k for k, m in enumerate(t.mask_values()) if m]
            rows += [start + len(p) - 1 + k for k in keep]
            targets += [r[k] for k in keep]
            beh += [float(t.behaviour_logprobs[k]) for k in keep]
            vers += [int(t.versions[k]) for k in keep]
            n = len(keep)
        adv += [float(advantages[i])] * n
        wts += [float(seq_weights[i])] * n
        seg += [j] * n
    return MicroBatch(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        rows=torch.tensor(rows, dtype=torch.int64),
        targets=torch.tensor(targets, dtype=torch.int64),
        behaviour_logp=torch.tensor(beh, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        token_weight=torch.tensor(wts, dtype=torch.float32),
        versions=torch.tensor(vers, dtype=torch.int64),
        seq_index=torch.tensor(seg, dtype=torch.int64),
        sample_ids=list(ids),
    )
