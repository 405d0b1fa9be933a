"""One trainer step's metrics, reduced over the trainer ranks (Trainer.step calls this)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from staleflow.train.batch import member_groups
from staleflow.trajectory import model_versions


def step_metrics(self, groups, tokens, rewards, adv, keep, sums, loss_total, grad_norms, t0) -> dict[str, float]:
    """The step's metrics: per-token sums reduced over the trainer ranks (max/min for the
    ``*_max``/``*_min`` keys), then per-token means, reward, length and staleness summaries.
    ``self`` is the Trainer (its device, group, version, optimizer); ``groups`` the step's TrainGroups,
    ``tokens`` their payloads flattened (`batch.step_payloads`), ``rewards``/``adv``/``keep`` per payload."""
    maxes = {k: v for k, v in sums.items() if k.endswith("_max")}
    mins = {k: v for k, v in sums.items() if k.endswith("_min")}
    adds = {k: v for k, v in sums.items() if k not in maxes and k not in mins}
    adds["loss"] = loss_total
    keys = sorted(adds)
    vec = torch.stack([torch.as_tensor(adds[k], dtype=torch.float64, device=self.device) for k in keys])
    ext_keys = sorted(maxes) + sorted(mins)
    ext = (
        torch.stack([torch.as_tensor({**maxes, **mins}[k], dtype=torch.float64, device=self.device) for k in ext_keys])
        if ext_keys
        else None
    )
    if self.sharded:  # on the trainer's device: NCCL reduces CUDA tensors only
        dist.all_reduce(vec, group=self.group)
        if ext is not None:
            n_max = len(maxes)
            hi, lo = ext[:n_max].clone(), ext[n_max:].clone()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.group)
            ext = torch.cat([hi, lo])
    adds = dict(zip(keys, vec.cpu().tolist()))
    extremes = dict(zip(ext_keys, ext.cpu().tolist())) if ext is not None else {}
    kept = [t for t, k in zip(tokens, keep) if k]
    group_of = member_groups(groups)
    v_traj = [g.traj_version for g in groups for _ in g.rewards]  # each member's V_traj
    n_tok = sum(t.num_trained for t in kept)  # the rows the loss trained (environment tokens are none)
    out: dict[str, float] = {
        "version": float(self.version),
        "loss": float(adds.pop("loss")),
        "grad_norm": max(grad_norms) if grad_norms else 0.0,
        "lr": float(self.optimizer.param_groups[0]["lr"]),
        "samples": float(len(tokens)),
        "samples_trained": float(len(kept)),
        "groups_dropped": float(len(set(group_of)) - len({g for g, k in zip(group_of, keep) if k})),
        "response_tokens": float(n_tok),
        "oversize_sequences": float(self._oversize),
        "reward_mean": sum(float(r) for g in groups for r in g.rewards) / max(len(tokens), 1),
        "reward_shaped_mean": sum(rewards) / max(len(rewards), 1),
        "advantage_abs_mean": sum(abs(a) for a in adv) / max(len(adv), 1),
        "response_len_mean": sum(len(t.response_ids) for t in tokens) / max(len(tokens), 1),
        "response_len_max": float(max((len(t.response_ids) for t in tokens), default=0)),
        "traj_staleness_mean": sum(self.version - 1 - v for v in v_traj) / max(len(tokens), 1),
        "traj_staleness_max": float(max((self.version - 1 - v for v in v_traj), default=0)),
        "step_time_s": time.perf_counter() - t0,
    }
    versions = [model_versions(t) for t in kept]  # of the model's tokens
    token_versions = [v for vs in versions for v in vs]
    if token_versions:
        out["token_staleness_mean"] = sum(self.version - 1 - v for v in token_versions) / len(token_versions)
        # mixed-version responses (a pull that kept the KV, or a migration, mid-response): the share of
        # tokens sampled by a later version than their response's first token, and of such responses
        out["mixed_token_frac"] = sum(v != vs[0] for vs in versions for v in vs) / len(token_versions)
        out["mixed_traj_frac"] = sum(len(set(vs)) > 1 for vs in versions) / len(kept)
    for k, v in adds.items():
        out[f"{k}_mean"] = float(v) / max(n_tok, 1)
    out.update(extremes)
    return out
