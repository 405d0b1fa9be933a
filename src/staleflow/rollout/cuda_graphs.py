"""CUDA graphs of the built-in engine's decode step (--rollout.cuda-graphs, off by default).

A decode step of a small model is launch-bound: hundreds of kernels of a few microseconds each.
With the flag, a step in which every scheduled sequence feeds exactly one token (pure decode) of
B sequences replays a graph captured once for the smallest batch-size bucket >= B:

1. static device buffers hold the step's inputs: token ids, positions, cache slots (int64) and
   context lengths + block tables (int32), each group packed in one buffer so a step's inputs go
   up in two host-to-device copies from pinned staging buffers;
2. padded rows (B..bucket) feed token 0 at position 0, write their K/V to the cache's null slot
   and attend one key of block 0 (read only): they change nothing;
3. the graph runs embed -> layers (paged K/V write + the Triton / flash-attn paged decode kernel,
   whose grid is sized for --rollout.max-model-len so it never depends on the step) -> the fp32
   logits of every row, into a static output; sampling stays eager (per-row parameters);
4. capture: largest bucket first, all buckets in one memory pool, each after two warm-up runs on
   a side stream (Triton compiles, cuBLAS picks its kernels) with every write aimed at the null
   slot. Weight loads copy in place (same pointers), so graphs survive pulls. Where cuBLAS has no
   ``torch.mm(out_dtype=)`` the logits come from an fp32 copy of the LM head (SampledLogits) that
   only Python refreshes: ``run`` calls ``SampledLogits.refresh()`` before every replay, so a
   replay after a pull never samples from the previous version's head.
5. the graphs hold their runner weakly (no reference cycle: dropping the engine frees its KV cache
   and graph pool at once, not at the next garbage collection); ``release()`` drops them now.
Steps with prefill chunks, or more sequences than the largest bucket, run eagerly.

The flag needs the engine on CUDA, a paged decode kernel (triton or flash) and a dense model (a
mixture-of-experts step sizes its expert GEMMs from routing read back to the host); anything else
is a one-line EngineError at engine build (a CPU run with the flag fails before it starts).
"""

from __future__ import annotations

import weakref

import torch

from staleflow.rollout.engine import EngineError
from staleflow.rollout.paged_attention import StepContext

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
"""Captured batch sizes (vLLM-like spacing); the engine's max_running is always one of them."""


def buckets_for(max_batch: int) -> list[int]:
    return sorted({b for b in BUCKETS if b < max_batch} | {max_batch})


def check_cuda_graphs(device: torch.device, backend: str, args) -> None:
    """A one-line EngineError when decode steps cannot be captured here."""
    if torch.device(device).type != "cuda":
        raise EngineError(
            f"--rollout.cuda-graphs needs the rollout engine on a CUDA device (it runs on {device}): drop the flag"
        )
    if backend not in ("triton", "flash"):
        raise EngineError(
            f"--rollout.cuda-graphs needs the triton or flash decode backend (got {backend!r}): "
            f"use --rollout.decode-backend auto"
        )
    if getattr(args, "is_moe", False):
        raise EngineError(
            "--rollout.cuda-graphs cannot capture a mixture-of-experts model (each step routes its tokens to "
            "experts chosen on the device, read back to size the expert GEMMs): drop the flag for this model"
        )
    if args.rope_type == "dynamic":
        raise EngineError(
            "--rollout.cuda-graphs cannot capture dynamic RoPE (its frequencies follow the longest "
            "position, read from the device every step): drop the flag for this model"
        )


class DecodeGraphs:
    """The captured decode steps of one ModelRunner. ``replay=False`` runs the same static-buffer
    forward eagerly instead of capturing it (what tests can check on CPU)."""

    def __init__(self, runner, max_batch: int, max_model_len: int, replay: bool = True):
        if replay:
            check_cuda_graphs(runner.device, runner.backend, runner.model.args)
        self._runner = weakref.ref(runner)
        self.replay = replay
        dev = runner.device
        self.buckets = buckets_for(max_batch)
        bmax = self.buckets[-1]
        self.bmax = bmax
        self.max_blocks = -(-max_model_len // runner.block_size)
        self.max_len = max_model_len
        # int64 [ids | positions | slots], int32 [context lens | block tables (bmax x max_blocks)]
        self.dev64 = torch.zeros(3 * bmax, dtype=torch.int64, device=dev)
        self.dev32 = torch.zeros(bmax + bmax * self.max_blocks, dtype=torch.int32, device=dev)
        pin = dev.type == "cuda"
        self.host64 = torch.zeros(3 * bmax, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(bmax + bmax * self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.captured = False

    @property
    def runner(self):
        runner = self._runner()
        if runner is None:
            raise RuntimeError("DecodeGraphs outlived its ModelRunner")
        return runner

    def release(self) -> None:
        """Drop the captured graphs, their outputs and memory pool (the static buffers go with self)."""
        self.graphs.clear()
        self.logits.clear()
        self.captured = False

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n sequences, None above the largest."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _context(self, b: int) -> StepContext:
        bm = self.bmax
        return StepContext(
            slot_mapping=self.dev64[2 * bm : 2 * bm + b],
            num_decode=b,
            block_tables=self.dev32[bm : bm + bm * self.max_blocks].view(bm, self.max_blocks)[:b],
            context_lens=self.dev32[:b],
            decode_len=self.max_len,
        )

    def _forward(self, b: int) -> torch.Tensor:
        """The captured computation: logits [b, V] fp32 of the rows in the static buffers."""
        r, bm = self.runner, self.bmax
        r.attn.ctx = self._context(b)
        try:
            hidden = r.model(self.dev64[:b], self.dev64[bm : bm + b], r.attn)  # [b, H]
        finally:
            r.attn.ctx = None
        return r.sampled_logits(hidden).float()

    def _reset(self) -> None:
        """Every row a padding row: token 0 at position 0, K/V written to the null slot."""
        bm = self.bmax
        self.dev64.zero_()
        self.dev64[2 * bm :].fill_(self.runner.attn.null_slot)
        self.dev32.zero_()
        self.dev32[:bm].fill_(1)

    def capture(self) -> None:
        """Capture every bucket, the largest first, in one memory pool."""
        dev = self.runner.device
        self._reset()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        for b in reversed(self.buckets):
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(b)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(dev)
        self.captured = True

    def stage(self, seqs, slot_of) -> int:
        """Write the step's inputs for ``seqs`` (padding up to their bucket) and copy them to the
        device in two copies; returns the bucket. ``slot_of(seq, position)``: a cache slot."""
        n, bm, mb = len(seqs), self.bmax, self.max_blocks
        b = self.bucket(n)
        h64, h32 = self.host64.numpy(), self.host32.numpy()
        tables = h32[bm:].reshape(bm, mb)
        h64[:b], h64[bm : bm + b], h64[2 * bm : 2 * bm + b] = 0, 0, self.runner.attn.null_slot
        h32[:b], tables[:b] = 1, 0
        for i, s in enumerate(seqs):
            pos = s.num_computed
            h64[i], h64[bm + i], h64[2 * bm + i] = s.token_at(pos), pos, slot_of(s, pos)
            h32[i] = pos + 1
            tables[i, : len(s.block_table)] = s.block_table
        # The previous step's copies are done: its tokens reached the host after them (one sync).
        self.dev64.copy_(self.host64, non_blocking=True)
        used = bm + b * mb
        self.dev32[:used].copy_(self.host32[:used], non_blocking=True)
        return b

    def run(self, seqs, slot_of) -> torch.Tensor:
        """fp32 logits [len(seqs), V] of a pure-decode step over ``seqs``."""
        if self.replay and not self.captured:
            self.capture()
        b = self.stage(seqs, slot_of)
        if not self.replay:
            return self._forward(b)[: len(seqs)]
        self.runner.sampled_logits.refresh()  # the fp32 LM head (if in use) after a pull: in place
        self.graphs[b].replay()
        return self.logits[b][: len(seqs)]


__all__ = ["BUCKETS", "DecodeGraphs", "buckets_for", "check_cuda_graphs"]
