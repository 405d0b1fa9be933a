"""The reward model's rows of the memory plan (``--reward.model``): one per reward-model process.

Each process (``--reward.model-workers``) holds its own copy of the model on
``--reward.model-device``: counted from the model built on the meta device from its config.json by
transformers (``trust_remote_code=False``: no code from the folder), in ``--reward.model-dtype``.
On a GPU (cuda:N) the rows add to GPU N's total, with a CUDA context each; on the CPU they are host
memory, reported and not held against any GPU. The forward's workspace is an estimate: one layer's
largest tensors for a full batch (``--reward.model-batch-size`` x ``--reward.model-max-tokens``),
plus, on the CPU, the [batch, heads, T, T] attention scores of SDPA's math path (CUDA's fused
kernels keep none).
"""

from __future__ import annotations

from staleflow.plan.estimate import PRIMARY_CONTEXT_BYTES, RankPlan


def reward_model_params(folder: str) -> tuple[int, dict]:
    """(parameters, config dict) of the reward model at ``folder``, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from staleflow.reward.model_scorer import check_reward_model_folder

    config = check_reward_model_folder(folder)
    hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(hf_config)
    return sum(p.numel() for p in model.parameters()), config


def reward_model_ranks(cfg, device_type: str) -> list[RankPlan]:
    """One RankPlan per reward-model process (rank -1, -2, ...: not torchrun ranks), or none."""
    rc = cfg.reward
    if not rc.model:
        return []
    from staleflow.reward.model_scorer import resolve_dtype

    params, config = reward_model_params(rc.model)
    on_gpu = rc.model_device.startswith("cuda")
    itemsize = resolve_dtype(rc.model_dtype, rc.model_device).itemsize
    hidden = int(config.get("hidden_size") or config.get("d_model") or config.get("n_embd") or 0)
    inter = int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden)
    heads = int(config.get("num_attention_heads") or config.get("n_head") or 1)
    tokens = rc.model_batch_size * rc.model_max_tokens
    work = tokens * (4 * hidden + 2 * inter) * itemsize
    if not on_gpu:
        work += rc.model_batch_size * heads * rc.model_max_tokens**2 * itemsize  # SDPA math path's scores
    rows = []
    for i in range(rc.model_workers):
        plan = RankPlan(-1 - i, "reward", int(rc.model_device.split(":")[1]) if on_gpu else None)
        where = rc.model_device if on_gpu else "host memory (cpu), not on a GPU"
        plan.add("weights", params * itemsize, f"reward model {params / 1e9:.3f}B params, {where}")
        plan.add("workspace", work, f"one forward of {rc.model_batch_size} x {rc.model_max_tokens} tokens (estimate)")
        if on_gpu and device_type == "cuda":
            plan.add("contexts", PRIMARY_CONTEXT_BYTES)
        plan.load_peak = params * itemsize  # transformers loads it straight in its dtype
        rows.append(plan.finish())
    return rows
