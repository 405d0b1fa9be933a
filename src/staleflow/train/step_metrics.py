"""One trainer step's metrics, reduced over the trainer ranks (Trainer.step calls this)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from staleflow.trajectory import model_versions


def step_metrics(self, samples, rewards, adv, keep, sums, loss_total, grad_norms, t0) -> dict[str, float]:
    """The step's metrics: per-token sums reduced over the trainer ranks (max/min for the
    ``*_max``/``*_min`` keys), then per-token means, reward, length and staleness summaries.
    ``self`` is the Trainer (its device, group, version, optimizer)."""
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
    kept = [s for s, k in zip(samples, keep) if k]
    n_tok = sum(s.tokens.num_trained for s in kept)  # the rows the loss trained (environment tokens are none)
    out: dict[str, float] = {
        "version": float(self.version),
        "loss": float(adds.pop("loss")),
        "grad_norm": max(grad_norms) if grad_norms else 0.0,
        "lr": float(self.optimizer.param_groups[0]["lr"]),
        "samples": float(len(samples)),
        "samples_trained": float(len(kept)),
        "groups_dropped": float(len({s.group_id for s in samples}) - len({s.group_id for s in kept})),
        "response_tokens": float(n_tok),
        "oversize_sequences": float(self._oversize),
        "reward_mean": sum(float(s.reward) for s in samples) / max(len(samples), 1),
        "reward_shaped_mean": sum(rewards) / max(len(rewards), 1),
        "advantage_abs_mean": sum(abs(a) for a in adv) / max(len(adv), 1),
        "response_len_mean": sum(len(s.tokens.response_ids) for s in samples) / max(len(samples), 1),
        "response_len_max": float(max((len(s.tokens.response_ids) for s in samples), default=0)),
        "traj_staleness_mean": sum(self.version - 1 - s.traj_version for s in samples) / max(len(samples), 1),
        "traj_staleness_max": float(max((self.version - 1 - s.traj_version for s in samples), default=0)),
        "step_time_s": time.perf_counter() - t0,
    }
    versions = [model_versions(s.tokens) for s in kept]  # of the model's tokens
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
