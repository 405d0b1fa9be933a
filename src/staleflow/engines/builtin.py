"""``--rollout.engine builtin`` (the default): the pure-PyTorch engine of rollout/ on the rank's own model.

The rank loads the policy in the rollout dtype (launch/entry.py), the engine copies pulled weights
straight into its parameters (servers/weights.LocalWeights), any layout the runtime accepts runs,
and the memory plan counts its model, its paged KV cache, its step workspace and, on CUDA, its
prefill mask and captured decode graphs, from the engine built on the meta device.
"""

from __future__ import annotations

from staleflow.engines.backend import EngineBackend, register_engine

MiB = 2**20


@register_engine("builtin")
class BuiltinBackend(EngineBackend):
    loads_partial_weights = True  # BuiltinEngine.load_weights(strict=False): LoRA runs' merged projections

    def build(self, ctx, model, gpu_share: float | None):
        from staleflow.rollout.builtin_engine import BuiltinEngine

        cfg = ctx.cfg
        return BuiltinEngine.from_config(cfg.model, cfg.rollout, model=model, seed=cfg.seed * 1000 + ctx.rank)

    def plan_rank(self, site):
        """A rollout rank running the built-in engine, built on the meta device as from_config builds it."""
        from staleflow.rollout.builtin_engine import BuiltinEngine

        plan, dtype, rc, args = site.new_plan(), site.dtype, site.cfg.rollout, site.args
        engine = BuiltinEngine(
            site.meta_model(),
            max_running=rc.max_running,
            max_kv_tokens=rc.max_kv_tokens,
            block_size=rc.block_size,
            prefill_chunk_tokens=rc.prefill_chunk_tokens,
            max_model_len=rc.max_model_len,
            decode_backend="gather",
            prefix_sharing=rc.prefix_sharing,
        )
        plan.add("weights", site.unique_bytes(engine.model.parameters()), f"built-in engine in {dtype}")
        attn = engine.runner.attn
        kv_tokens = engine.block_manager.capacity_tokens
        plan.add("kv_cache", attn.k_cache.nbytes + attn.v_cache.nbytes, f"{kv_tokens} tokens (paged, K and V)")
        head = args.vocab_size * args.hidden_size
        if dtype.itemsize < 4 and site.device_type != "cuda":  # SampledLogits keeps an fp32 LM head off CUDA
            plan.add("workspace", head * 4, "the sampler's fp32 copy of the LM head")
        plan.add("workspace", site.workspace_bytes(), "step activations and sampler")
        if site.device_type == "cuda":
            n, ctx = rc.prefill_chunk_tokens, rc.max_model_len
            plan.add(
                "prefill_mask",
                site.prefill_mask_bytes(),
                f"masked prefill: [{n} x {ctx}] bool mask + SDPA's additive copy (broadcast over heads)",
            )
            plan.add("contexts", site.context_bytes)
            pool = site.graph_pool_bytes()
            if rc.cuda_graphs:
                plan.add("graphs", pool, f"captured decode steps of {rc.max_running} sequences at most (one pool)")
            elif args.is_moe:
                plan.notes.append("graphs: --rollout.cuda-graphs does not capture mixture-of-experts models")
            else:
                plan.notes.append(f"graphs: --rollout.cuda-graphs off (on, its pool adds {pool / MiB:.0f} MiB)")
        else:
            plan.notes.append("kv_cache: on CPU the decode mirror adds up to the KV cache again, as used")
        layer = max(sum(p.numel() for p in layer.parameters()) for layer in engine.model.model.layers)
        # launch/entry.py loads in the engine's dtype, casting one tensor at a time (read as fp32 at most),
        # and fuse_projections then builds one layer's fused matrices beside the loaded ones
        plan.load_peak = site.load_bytes(engine.model) + layer * dtype.itemsize
        return plan.finish()
