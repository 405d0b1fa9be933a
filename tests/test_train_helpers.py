"""Shared fixtures for the trainer tests: a tiny CausalLM, random groups of trajectories, a toy sampler.

Imported by tests/test_train_*.py (pytest puts tests/ on sys.path); holds no tests itself.
"""

from __future__ import annotations

import random

import torch

from staleflow.model import CausalLM, ModelArgs, PackedAttention, cu_seqlens_from_lengths, packed_positions
from staleflow.train.batch import step_payloads
from staleflow.trajectory import RecordHandle, TrainGroup, TrajectoryTokens

VOCAB = 32


def tiny_model(seed: int = 0, arch: str = "llama", tied: bool = True, vocab: int = VOCAB) -> CausalLM:
    args = ModelArgs(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
        max_position_embeddings=256,
    )
    return CausalLM(args).init_weights(std=0.1, seed=seed)


def train_group(group_id: int, traj_version: int, rewards: list[float], members: list[TrajectoryTokens]) -> TrainGroup:
    """A TrainGroup for payloads that are in no ring (the trainer never reads the handles: it is given
    the payloads); trajectory ids group_id * 100 + k."""
    n = len(members)
    ids = [group_id * 100 + k for k in range(n)]
    handles = [RecordHandle(-1, 0, 0, 0)] * n
    prompt_len = len(members[0].prompt_ids) if members else 0
    return TrainGroup(
        group_id, traj_version, ids, handles, list(rewards), [len(t.response_ids) for t in members], prompt_len
    )


def random_batch(
    seed: int = 0,
    groups: int = 4,
    group_size: int = 4,
    max_prompt: int = 6,
    max_response: int = 8,
    vocab: int = VOCAB,
    min_response: int = 0,
    stale: bool = True,
) -> tuple[list[TrainGroup], list[list[TrajectoryTokens]]]:
    """Random groups (V_traj 2) of trajectories with random rewards and behaviour log-probs (some
    zero-length responses): Trainer.step's (groups, payloads)."""
    rng = random.Random(seed)
    out_groups, out_payloads = [], []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
        members, rewards = [], []
        for _ in range(group_size):
            n = rng.randint(min_response, max_response)
            resp = [rng.randrange(vocab) for _ in range(n)]
            beh = [-rng.uniform(2.5, 4.5) for _ in range(n)]
            members.append(TrajectoryTokens(prompt, resp, beh, [3 - stale * rng.randint(0, 1)] * n))
            rewards.append(float(rng.randint(0, 3)))
        out_groups.append(train_group(g, 2, rewards, members))
        out_payloads.append(members)
    return out_groups, out_payloads


def flat(batch: tuple[list[TrainGroup], list[list[TrajectoryTokens]]]) -> list[TrajectoryTokens]:
    """A batch's payloads in the trainer's member order (what _plan and build_micro_batch index)."""
    return step_payloads(*batch)


@torch.no_grad()
def sample_responses(model: CausalLM, prompts: list[list[int]], max_new: int, gen: torch.Generator):
    """Ancestral sampling with one packed forward per decode step (tiny models only)."""
    seqs = [list(p) for p in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    for _ in range(max_new):
        cu = cu_seqlens_from_lengths([len(s) for s in seqs])
        ids = torch.tensor([t for s in seqs for t in s])
        hidden = model(ids, packed_positions(cu), PackedAttention(cu))
        last = hidden[cu[1:].long() - 1]  # [B, H]
        logp = torch.log_softmax(model.compute_logits(last), -1)  # [B, V]
        tok = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
        for i, t in enumerate(tok.tolist()):
            seqs[i].append(t)
            logps[i].append(float(logp[i, t]))
    return [s[len(p) :] for s, p in zip(seqs, prompts)], logps


def capture_grads(trainer) -> list[dict[str, torch.Tensor]]:
    """Record the (full) gradients each optimizer update sees."""
    seen: list[dict[str, torch.Tensor]] = []

    def hook(optimizer, args, kwargs):
        g = {}
        for n, p in trainer.policy.named_parameters():
            grad = p.grad
            if grad is not None and hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            g[n] = None if grad is None else grad.detach().clone()
        seen.append(g)

    trainer.optimizer.register_step_pre_hook(hook)
    return seen


def lipschitz_adam(trainer) -> None:
    """AdamW's g / (sqrt(v) + eps) turns fp32 reassociation noise on near-zero gradients into
    O(lr) weight differences; a large eps makes the update Lipschitz in g, so weights can be
    compared after a step with fp32 tolerances (gradients are compared directly as well)."""
    trainer.optimizer.param_groups[0]["eps"] = 1e-3


def assert_same(a: dict, b: dict, atol=2e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=lambda m: f"{k}: {m}")
