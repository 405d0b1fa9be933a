"""``--rollout.engine vllm``: vLLM's engine (rollout/vllm_engine.py), the optional extra staleflow[vllm].

Everything that differs from the built-in engine is here, and only here:
- the rank loads no model: vLLM loads the checkpoint in its own engine process;
- on CUDA the engine starts with its own GPU first and no other rollout rank's GPU visible, and
  asks for the share of the GPU the memory plan gives it (``gpu_memory_utilization``);
- its worker process maps the Parameter Server itself, with its own reader index
  (servers/weights.EngineLoadsItself), so every rollout rank must be on the Parameter Server's node;
- the memory plan counts its weights, the KV cache it is told to allocate, its profiled step and,
  on CUDA, its CUDA graphs and the engine process's second context.
vLLM is imported only when an engine is built (CI has none): this module imports without it.
"""

from __future__ import annotations

from staleflow.config import ConfigError
from staleflow.engines.backend import EngineBackend, register_engine

GRAPH_BYTES = 1 << 30
"""vLLM's CUDA graphs when enforce_eager is off (it logs 0.5-1.5 GiB for 7-8B models)."""


@register_engine("vllm")
class VllmBackend(EngineBackend):
    rank_loads_model = False
    takes_gpu_share = True
    extras = (("vllm", "pip install 'staleflow[vllm]'"),)

    def build(self, ctx, model, gpu_share: float | None):
        from staleflow.rollout.vllm_engine import VllmEngine  # optional extra; clear error when missing

        cfg = ctx.cfg
        return VllmEngine.from_config(
            cfg.model, cfg.rollout, model_path=cfg.model.path, **_cuda_settings(ctx, gpu_share)
        )

    def weight_source(self, run_id: str, reader: int, worker_reader: int):
        from staleflow.servers.weights import EngineLoadsItself

        return EngineLoadsItself(run_id, worker_reader)

    def check_placement(self, topology) -> None:
        if topology.remote_pullers:
            raise ConfigError(
                f"{self.flag} on rollout ranks {topology.remote_pullers}, which do not read every weight from "
                f"node {topology.home}'s Parameter Server: a vLLM worker maps it by CUDA IPC, so it must run "
                f"there, and that node must hold every piece; use --rollout.engine builtin for this layout"
            )

    def plan_rank(self, site):
        """A rollout rank whose vLLM engine (another process) holds weights, KV cache and graphs."""
        from staleflow.rollout.vllm_support import vllm_kv_cache_bytes

        plan, dtype, rc = site.new_plan(), site.dtype, site.cfg.rollout
        plan.add("weights", site.weights_bytes(), f"vLLM engine in {dtype}")
        cuda = site.device_type == "cuda"
        kv, tokens = vllm_kv_cache_bytes(site.args, dtype, rc.max_kv_tokens, rc.block_size, cuda=cuda)
        plan.add("kv_cache", kv, f"{tokens} tokens (kv_cache_memory_bytes)")
        plan.add("workspace", site.workspace_bytes(), "vLLM's profiled step activations (estimate)")
        if cuda:
            plan.add("workspace", GRAPH_BYTES, "CUDA graphs")
            plan.add("contexts", 2 * site.context_bytes, "the rank's and the engine process's")
        return plan.finish()


def _cuda_settings(ctx, gpu_share: float | None) -> dict:
    """A vLLM rank on a GPU: its engine starts with its own GPU first and no other rollout rank's
    visible, and asks for the GPU share the memory plan gives it."""
    if not str(ctx.device).startswith("cuda"):
        return {}
    import os

    import torch

    from staleflow.cluster.placement import engine_visible_devices, gpu_of

    gpus = torch.cuda.device_count()
    pieces = [gpu_of(t, gpus) for t in ctx.roles.trainer_ranks]
    return {
        "gpu_memory_utilization": gpu_share,
        "visible_devices": engine_visible_devices(
            torch.device(ctx.device).index, pieces, gpus, os.environ.get("CUDA_VISIBLE_DEVICES")
        ),
    }
