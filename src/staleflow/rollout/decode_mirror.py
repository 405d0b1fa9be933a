"""DecodeMirror: a dense copy of the decoding sequences' K/V, so decode attention reads it in place.

Without it every decode step gathers every running sequence's whole K/V out of the paged cache
into a padded [B, L] batch (a copy of all the KV bytes, per layer, per step) before SDPA reads
them again: on CPU that gather costs as much as the attention itself. The mirror keeps one row
per decoding sequence, `k, v: [layers, rows, Hkv, Lcap, D]`:
- a sequence's row is filled from the paged cache once, when it starts decoding (or after its
  K/V was recomputed: preemption, weight load), then gets one token per step, written next to
  the paged write; attention runs on `k[layer, :B, :, :Lmax]`, a view;
- rows are dense: a row whose sequence left the decode batch (finished, aborted, preempted) is
  refilled by moving the last row into it (one copy of one sequence's K/V), and the decode part
  of the step's batch is put in row order, so no query or output permutation is needed;
- storage grows by doubling (rows up to max_rows, length up to max_len) and is zero-initialised:
  a padded position is masked, but 0 * NaN garbage would still poison SDPA's output.
The paged cache stays the source of truth (prefill, preemption, memory accounting); the mirror
costs a second copy of the decoding sequences' K/V, padded to the longest row. It never holds
more token slots than `budget_tokens` (the engine passes the paged cache's capacity, so K/V memory
at most doubles): a step whose rows x length would exceed it releases the mirror and gathers
instead (`prepare` returns None). A row is valid while its sequence keeps the
same `kv_epoch` (bumped whenever the block manager frees its blocks) and `num_computed` (a
speculative step writes the draft's K/V too, and `clip` forgets the rejected part).
"""

from __future__ import annotations

import torch

from staleflow.rollout.sequence import Sequence


class DecodeMirror:
    def __init__(
        self,
        num_layers: int,
        max_rows: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        budget_tokens: int | None = None,
        min_len: int = 128,
    ):
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.max_rows, self.max_len, self.min_len = max_rows, max_len, min_len
        self.budget_tokens = budget_tokens if budget_tokens is not None else max_rows * max_len
        self.fallbacks = 0
        """Steps that gathered from the paged cache because the mirror would exceed its budget."""
        self.dtype, self.device = dtype, device
        self.k = self.v = torch.zeros(0)
        self.rows: list[Sequence] = []
        """rows[r] is the sequence whose K/V row r holds."""
        self.row_epoch: list[int] = []
        self.row_len: list[int] = []
        self._alloc(0, 0)

    @property
    def capacity(self) -> tuple[int, int]:
        return self.k.shape[1], self.k.shape[3]

    def _alloc(self, rows: int, length: int) -> None:
        layers, hkv, d = self.shape
        k = torch.zeros(layers, rows, hkv, length, d, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        if self.k.numel():
            r, n = min(rows, self.k.shape[1]), min(length, self.k.shape[3])
            k[:, :r, :, :n] = self.k[:, :r, :, :n]
            v[:, :r, :, :n] = self.v[:, :r, :, :n]
        self.k, self.v = k, v

    def _grown(self, rows: int, length: int) -> tuple[int, int]:
        """Capacity after growing (by doubling) to hold rows x length."""
        cap_rows, cap_len = self.capacity
        new_rows = cap_rows if rows <= cap_rows else min(self.max_rows, max(rows, 2 * cap_rows, 8))
        new_len = cap_len if length <= cap_len else min(self.max_len, max(length, 2 * cap_len, self.min_len))
        for r, n in ((new_rows, new_len), (max(rows, cap_rows), max(length, cap_len)), (rows, length)):
            if r * n <= self.budget_tokens:  # doubled, else just enough, else shrunk to fit exactly
                return r, n
        return rows, length

    def _move(self, src: int, dst: int) -> None:
        n = self.row_len[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.rows[dst], self.row_epoch[dst], self.row_len[dst] = self.rows[src], self.row_epoch[src], n

    def clear(self) -> None:
        self.rows, self.row_epoch, self.row_len = [], [], []

    def prepare(
        self, seqs: list[Sequence], k_cache: torch.Tensor, v_cache: torch.Tensor, slots_of
    ) -> list[Sequence] | None:
        """Make rows 0..len(seqs)-1 hold exactly these decoding sequences' cached K/V (positions
        0..num_computed-1) and return the sequences in row order. k_cache / v_cache: the paged
        caches [layers, slots, Hkv, D]; slots_of(seq, n) -> [n] slot ids of its first n tokens.
        Returns None (mirror released) when the rows would not fit in budget_tokens."""
        rows, length = self._grown(len(seqs), max(s.num_computed + 1 + len(s.draft) for s in seqs))
        if rows * length > self.budget_tokens:
            self.clear()
            self._alloc(0, 0)
            self.fallbacks += 1
            return None
        wanted = {id(s): s for s in seqs}
        keep = [
            r
            for r, s in enumerate(self.rows)
            if id(s) in wanted and self.row_epoch[r] == s.kv_epoch and self.row_len[r] == s.num_computed
        ]
        # compact: surviving rows move down into the holes, in order
        for dst, src in enumerate(keep):
            if src != dst:
                self._move(src, dst)
        del self.rows[len(keep) :], self.row_epoch[len(keep) :], self.row_len[len(keep) :]
        have = {id(s) for s in self.rows}
        new = [s for s in seqs if id(s) not in have]
        if (rows, length) != self.capacity:
            self._alloc(rows, length)
        for s in new:  # fill from the paged cache (all layers at once)
            r, n = len(self.rows), s.num_computed
            if n:
                slots = slots_of(s, n)
                self.k[:, r, :, :n] = k_cache[:, slots].transpose(1, 2)
                self.v[:, r, :, :n] = v_cache[:, slots].transpose(1, 2)
            self.rows.append(s)
            self.row_epoch.append(s.kv_epoch)
            self.row_len.append(n)
        return list(self.rows)

    def advance(self) -> None:
        """After a step: every row received its sequence's fed tokens (the last token and its draft)."""
        self.row_len = [n + 1 + len(s.draft) for n, s in zip(self.row_len, self.rows)]

    def clip(self) -> None:
        """After a speculative step's verification: a row keeps only its sequence's verified positions
        (the rejected drafts' K/V past num_computed is forgotten, as in the paged cache)."""
        self.row_len = [min(n, s.num_computed) for n, s in zip(self.row_len, self.rows)]
