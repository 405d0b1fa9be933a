"""ModelRunner: turns a ScheduledBatch into one packed forward pass over the paged KV cache.

It owns the model and the cache (PagedAttention). `run(batch)` builds the step's index
tensors once (tokens, positions, cache slots, padded decode contexts, prefill masks), runs
`model(input_ids, positions, attn)` and returns fp32 logits only for the sequences whose feed
completes this step (decodes, and prefills whose last chunk this is) - those get a new token.
The decode backend is resolved once here (`decode_backend.resolve_decode_backend`): with a
DecodeMirror (the CPU default) the decode part of the batch is first put in mirror-row order and
decode attention reads the dense rows; with "triton" / "flash" (CUDA) it gets the decoding
sequences' block tables and context lengths and a kernel reads the paged cache in place;
"gather" builds padded slot indices. Masks are built on the device (from positions already there),
never on the host and copied. With --rollout.cuda-graphs a pure-decode step replays a captured
graph instead (cuda_graphs.py). The sampled rows' logits are fp32 products of the hidden
state and the LM head (`SampledLogits`), the numbers the trainer computes at the same weights.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from staleflow.rollout.block_manager import BlockManager
from staleflow.rollout.cuda_graphs import DecodeGraphs
from staleflow.rollout.decode_backend import resolve_decode_backend
from staleflow.rollout.decode_mirror import DecodeMirror
from staleflow.rollout.paged_attention import PagedAttention, PrefillChunk, StepContext
from staleflow.rollout.scheduler import ScheduledBatch
from staleflow.rollout.staging import HostStaging


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        block_manager: BlockManager,
        max_running: int = 64,
        max_model_len: int = 2048,
        decode_mirror: bool | None = None,
        decode_backend: str = "auto",
        cuda_graphs: bool = False,
    ):
        """cuda_graphs: replay captured pure-decode steps (cuda_graphs.py); an EngineError off CUDA."""
        self.model = model
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        args = model.args
        self.attn = PagedAttention(
            args.num_layers, block_manager.capacity_tokens, args.num_kv_heads, args.head_dim, self.dtype, self.device
        )
        if decode_mirror is not None and decode_backend == "auto":  # the older switch: mirror or gather
            decode_backend = "mirror" if decode_mirror else "gather"
        self.backend = resolve_decode_backend(decode_backend, self.device, self.dtype, self.block_size)
        self.mirror = (
            DecodeMirror(
                args.num_layers,
                max_running,
                max_model_len,
                args.num_kv_heads,
                args.head_dim,
                self.dtype,
                self.device,
                budget_tokens=block_manager.capacity_tokens,
            )
            if self.backend == "mirror"
            else None
        )
        self.attn.mirror = self.mirror
        self.attn.backend, self.attn.block_size = self.backend, self.block_size
        self.group = args.num_heads // args.num_kv_heads
        self.sampled_logits = SampledLogits(model)
        self.staging = HostStaging(self.device, torch.int64)
        self.graphs = DecodeGraphs(self, max_running, max_model_len) if cuda_graphs else None

    def _slots(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        """[end - start] cache slots of positions start..end-1 of one sequence."""
        bs = self.block_size
        pos = np.arange(start, end)
        return np.asarray(block_table, dtype=np.int64)[pos // bs] * bs + pos % bs

    def _context(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, StepContext, list[int], torch.Tensor]:
        """The step's inputs: every host-built index array goes up in ONE copy (``HostStaging``);
        masks are built on the device from what arrived. Returns (input ids, positions, context,
        sampled batch rows, their rows in the packed step)."""
        dev = self.device
        ids: list[int] = []
        positions: list[int] = []
        slot_parts: list = []
        sample_rows: list[int] = []
        up: dict[str, object] = {}  # name -> host array, uploaded together below
        nd = batch.num_decode
        ctx = StepContext(slot_mapping=torch.empty(0), num_decode=nd)
        mask_len = 0  # > 0: decodes of unequal lengths need a key mask of this width
        mirrored = None
        if nd and self.mirror is not None:
            mirrored = self.mirror.prepare(
                batch.seqs[:nd],
                self.attn.k_cache,
                self.attn.v_cache,
                lambda s, n: torch.from_numpy(self._slots(s.block_table, 0, n)).to(dev),
            )
        if mirrored is not None:
            batch.seqs[:nd] = mirrored  # row order (the engine pairs batch.seqs with the sampled rows)
            batch.num_tokens[:nd] = [1 + len(s.draft) for s in mirrored]
        widths = batch.num_tokens[:nd]
        ctx.decode_tokens = sum(widths)
        if nd and max(widths) > 1:
            self._draft_context(batch.seqs[:nd], widths, ctx, up, slot_parts, mirrored is not None)
        elif mirrored is not None:
            seqs = mirrored
            lens = [s.num_computed + 1 for s in seqs]
            slot_parts.append([self.block_manager.slot(s, s.num_computed) for s in seqs])
            up["mirror_pos"] = [s.num_computed for s in seqs]
            ctx.decode_len = max(lens)
            mask_len = ctx.decode_len if min(lens) != ctx.decode_len else 0
        elif nd and self.backend in ("triton", "flash"):
            seqs = batch.seqs[:nd]
            lens = [s.num_computed + 1 for s in seqs]
            tables = np.zeros((nd, max(len(s.block_table) for s in seqs)), dtype=np.int64)  # padding never read
            for i, s in enumerate(seqs):  # row by row: 3x faster than torch.tensor(list of lists)
                tables[i, : len(s.block_table)] = s.block_table
            slot_parts.append([self.block_manager.slot(s, s.num_computed) for s in seqs])
            up["block_tables"], up["context_lens"] = tables, lens
            ctx.decode_len = max(lens)
        elif nd:
            seqs = batch.seqs[:nd]
            lens = np.array([s.num_computed + 1 for s in seqs])
            max_len = int(lens.max())
            tables = np.zeros((nd, max(len(s.block_table) for s in seqs)), dtype=np.int64)
            for i, s in enumerate(seqs):
                tables[i, : len(s.block_table)] = s.block_table
            pos = np.arange(max_len)
            slots = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size  # [B, Lmax]
            valid = pos[None, :] < lens[:, None]  # [B, Lmax]
            slots = np.where(valid, slots, self.attn.null_slot)
            slot_parts.append(slots[np.arange(nd), lens - 1])  # the new token's slot
            up["decode_slots"] = slots
            # equal lengths need no mask (SDPA's unmasked path is faster); else it is built on the device
            if lens.min() != max_len:
                up["decode_lens"] = lens
                mask_len = max_len
            ctx.decode_len = max_len
        # decodes feed their last token (and its draft, speculative.py); every fed decode token is
        # sampled: logits row j is the j-th fed decode token, of decode sample_rows[j]
        for i, s in enumerate(batch.seqs[:nd]):
            ids.append(s.token_at(s.num_computed))
            ids.extend(s.draft)
            positions.extend(range(s.num_computed, s.num_computed + 1 + len(s.draft)))
            sample_rows.extend([i] * (1 + len(s.draft)))
        offset = ctx.decode_tokens
        last_rows = list(range(offset))
        chunks = []
        for i in range(nd, len(batch)):
            seq, n = batch.seqs[i], batch.num_tokens[i]
            c = seq.num_computed
            ids.extend(seq.token_slice(c, c + n))
            positions.extend(range(c, c + n))
            ctx_slots = self._slots(seq.block_table, 0, c + n)
            slot_parts.append(ctx_slots[c:])
            if c:
                up[f"prefill{i}"] = ctx_slots
            chunks.append((i, offset, n, c))
            offset += n
            if c + n == len(seq):
                sample_rows.append(i)
                last_rows.append(offset - 1)
        up["slot_mapping"] = np.concatenate([np.asarray(p, dtype=np.int64) for p in slot_parts])
        up["input_ids"], up["positions"], up["last"] = ids, positions, last_rows
        got = dict(zip(up, self.staging.upload(list(up.values()))))
        ctx.slot_mapping = got["slot_mapping"]
        if "mirror_pos" in got:
            ctx.mirror_pos = got["mirror_pos"]
            if mask_len:  # built on the device from the positions already there
                valid = torch.arange(mask_len, device=dev)[None, :] <= ctx.mirror_pos[:, None]  # [B, Lmax]
                ctx.decode_mask = valid[:, None, None, :]
        if "block_tables" in got:
            ctx.block_tables = got["block_tables"].view(ctx.decode_tokens, -1).to(torch.int32)  # [Td, max_blocks]
            ctx.context_lens = got["context_lens"].to(torch.int32)  # [Td]
        if "draft_q_pos" in got:  # a speculative step: a causal block of queries per sequence
            ctx.decode_q_index, ctx.decode_out_index = got["draft_q_index"], got["draft_out_index"]
            ctx.mirror_rows = got.get("mirror_rows")
            if ctx.block_tables is None:
                w, g, n = ctx.decode_width, self.group, ctx.decode_len
                q_pos = got["draft_q_pos"].view(nd, w)
                valid = torch.arange(n, device=dev)[None, None, :] <= q_pos[:, :, None]  # [B, W, L]
                ctx.decode_mask = valid[:, :, None, :].expand(nd, w, g, n).reshape(nd, 1, w * g, n)
        if "decode_slots" in got:
            ctx.decode_slots = got["decode_slots"]
            if mask_len:
                lens_d = got["decode_lens"]
                ctx.decode_mask = (torch.arange(mask_len, device=dev)[None, :] < lens_d[:, None])[:, None, None, :]
        for i, start, n, c in chunks:
            if c == 0:
                ctx.prefills.append(PrefillChunk(start, start + n, None, None))
            else:  # the causal mask after c cached tokens, built on the device
                q_pos = torch.arange(c, c + n, device=dev)
                mask = torch.arange(c + n, device=dev)[None, :] <= q_pos[:, None]  # [n, L]
                ctx.prefills.append(PrefillChunk(start, start + n, got[f"prefill{i}"], mask))
        return got["input_ids"], got["positions"], ctx, sample_rows, got["last"]

    def _draft_context(
        self, seqs: list, widths: list[int], ctx: StepContext, up: dict, slot_parts: list, mirrored: bool
    ) -> None:
        """The decode part of a speculative step: sequence b feeds W_b = 1 + len(draft) tokens at
        positions c_b .. c_b + W_b - 1 (c_b = num_computed), query w seeing keys up to c_b + w.
        triton / flash: one kernel row per fed token (the sequence's block table, context c_b + w + 1);
        mirror / gather: B x W queries (padding repeats b's last token, its output dropped) over the
        sequence's keys, with a [B, 1, W * G, L] causal mask built on the device from their positions."""
        nd, width = len(seqs), max(widths)
        bs = self.block_size
        start = np.array([s.num_computed for s in seqs], dtype=np.int64)
        w = np.asarray(widths, dtype=np.int64)
        col = np.arange(width)
        last = np.minimum(col[None, :], w[:, None] - 1)  # [B, W]
        real = col[None, :] < w[:, None]  # [B, W]
        offsets = np.cumsum(w) - w
        tok_seq = np.repeat(np.arange(nd), w)  # [Td]
        tok_pos = (start[:, None] + col[None, :])[real]  # [Td]
        tables = np.zeros((nd, max(len(s.block_table) for s in seqs)), dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        slot_parts.append(tables[tok_seq, tok_pos // bs] * bs + tok_pos % bs)
        lens = start + w
        ctx.decode_len, ctx.decode_width = int(lens.max()), width
        up["draft_q_index"] = (offsets[:, None] + last).reshape(-1)
        up["draft_q_pos"] = (start[:, None] + last).reshape(-1)
        up["draft_out_index"] = (np.arange(nd)[:, None] * width + col[None, :])[real]
        if self.backend in ("triton", "flash"):
            up["block_tables"], up["context_lens"] = tables[tok_seq], tok_pos + 1
        elif mirrored:
            up["mirror_pos"], up["mirror_rows"] = tok_pos, tok_seq
        else:
            pos = np.arange(ctx.decode_len)
            slots = tables[:, pos // bs] * bs + pos % bs  # [B, Lmax]
            up["decode_slots"] = np.where(pos[None, :] < lens[:, None], slots, self.attn.null_slot)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[int]]:
        """Forward one step; returns (fp32 logits [N, V] or None, batch indices of those N rows: a
        decode with a draft has 1 + len(draft) consecutive rows, one per fed token)."""
        n = len(batch)
        drafts = any(s.draft for s in batch.seqs[: batch.num_decode])
        if self.graphs is not None and batch.num_decode == n and not drafts and self.graphs.bucket(n) is not None:
            return self.graphs.run(batch.seqs, self.block_manager.slot), list(range(n))
        input_ids, positions, ctx, sample_rows, last = self._context(batch)
        self.attn.ctx = ctx
        try:
            hidden = self.model(input_ids, positions, self.attn)  # [T, H]
        finally:
            self.attn.ctx = None
        if ctx.mirror_pos is not None:
            self.mirror.advance()
        if not sample_rows:
            return None, []
        logits = self.sampled_logits(hidden.index_select(0, last))  # [N, V]
        return logits.float(), sample_rows


class SampledLogits:
    """fp32 logits [N, V] of the rows being sampled, from hidden [N, H] and the LM head.

    A bf16 model's logits rounded to bf16 (off by up to half an ulp: 0.06 at |logit| 16) put a
    systematic gap between behaviour and trainer log-probs at identical weights; the trainer computes
    `hidden.float() @ W.float().T` (train/logprobs.py, `CausalLM.compute_logits`). Products of
    bf16 / fp16 values are exact in fp32, so the only difference left is fp32 summation order:
    - CUDA: `torch.mm(h, W^T, out_dtype=float32)` (16-bit tensor cores, fp32 accumulate and
      output, no copy of W); where that overload is missing, the path below;
    - elsewhere: an fp32 copy of W, made again only when W changed (its data pointer or
      in-place version counter moved: `load_weights`, a pull), since converting W every step
      cost more than the bf16 product itself on CPU (98 vs 15 ms for SmolLM2 at batch 32).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._w32: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self._mm_out_dtype = True

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.lm_head_weight  # [V, H]
        if w.dtype in (torch.float32, torch.float64):
            return self.model.compute_logits(hidden)
        if w.is_cuda and self._mm_out_dtype:
            try:
                return torch.mm(hidden, w.t(), out_dtype=torch.float32)
            except (TypeError, RuntimeError, NotImplementedError):
                self._mm_out_dtype = False
        return F.linear(hidden.float(), self.refresh())

    def refresh(self) -> torch.Tensor | None:
        """The fp32 copy of the LM head, copied again (in place: same storage) when W changed; None
        while no fp32 copy is in use. A captured decode graph reads the copy without running this
        Python, so DecodeGraphs calls ``refresh()`` before every replay: after a pull it would
        otherwise keep sampling from the previous version's head."""
        w = self.model.lm_head_weight
        if self._w32 is None and (w.dtype in (torch.float32, torch.float64) or (w.is_cuda and self._mm_out_dtype)):
            return None
        key = (w.data_ptr(), w._version)
        if key != self._key:
            if self._w32 is not None and self._w32.shape == w.shape and self._w32.device == w.device:
                self._w32.copy_(w)
            else:
                self._w32 = w.float()
            self._key = key
        return self._w32
