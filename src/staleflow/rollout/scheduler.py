"""Scheduler: continuous batching over a waiting queue and a running set.

Each step (`schedule()`):
1. every running sequence that is decoding gets its 1 token; when the cache has no block for
   it, the most recently admitted running sequence is preempted (its blocks are freed, it goes
   back to the FRONT of the waiting queue keeping all its tokens, and is re-prefilled later);
2. running sequences still in prefill get a chunk from the step's prefill token budget;
3. waiting sequences are admitted in FIFO order while the running cap, the budget and the
   free blocks (minus a small watermark that keeps room for decodes) allow; with a
   SharingBlockManager an admitted sequence first takes references on the cached full blocks
   of its prompt (the other members of its GRPO group computed them) and is fed only the rest,
   and every fed chunk registers the full prompt blocks it completes;
4. if nothing at all could be scheduled while sequences run (prefills blocking each other),
   the newest running sequence is preempted and scheduling retried.
The result is a ScheduledBatch: decodes first, then prefill chunks, each with its token count.

Held sequences (multi-turn, Request.hold) are PARKED between turns: in `parked`, out of both
queues, keeping their blocks; `resume` (engine.extend) puts one at the front of the waiting queue
still holding its blocks, and its admission feeds only the tokens after its cached K/V. Blocks
that sit idle (parked sequences, and resumed ones not yet admitted) are reclaimed before any
running sequence is preempted: a decode or a running prefill short of blocks, or a step that
could schedule nothing, frees the K/V of the least recently parked one first (`reclaim_idle`;
that sequence is re-prefilled whole when it runs again). A new request is not admitted by
evicting parked K/V while others run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from staleflow.rollout.block_manager import BlockManager
from staleflow.rollout.prefix_sharing import SharingBlockManager
from staleflow.rollout.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """What one engine step computes: seqs[i] is fed num_tokens[i] tokens from num_computed on."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_decode: int = 0
    """The first num_decode entries are decodes (1 token each; 1 + its draft in a speculative step)."""

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def prefill_tokens(self) -> int:
        return sum(self.num_tokens[self.num_decode :])


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_running: int, prefill_chunk_tokens: int):
        self.block_manager = block_manager
        self.max_running = max_running
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.watermark = max(1, block_manager.num_blocks // 100)
        self.num_preemptions = 0
        self.sharing = block_manager if isinstance(block_manager, SharingBlockManager) else None
        self.parked: dict[int, Sequence] = {}
        """id(seq) -> parked sequence, least recently parked first."""
        self.num_reclaimed = 0
        """Idle (parked or resumed-not-admitted) sequences whose K/V was freed for others."""

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished, aborted or released sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.PARKED:
            del self.parked[id(seq)]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def park(self, seq: Sequence) -> None:
        """A held sequence's turn stopped: out of the running set, its blocks kept."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PARKED
        self.parked[id(seq)] = seq

    def resume(self, seq: Sequence) -> None:
        """A parked sequence got its next turn (engine.extend): first in the waiting queue, with its blocks."""
        del self.parked[id(seq)]
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _holders(self):
        """Sequences that hold blocks, running or not."""
        yield from self.running
        yield from (s for s in self.parked.values() if s.block_table)
        yield from (s for s in self.waiting if s.block_table)

    def reclaim_idle(self) -> bool:
        """Free the K/V of one idle sequence (least recently parked first, then resumed ones not yet
        admitted, newest first); False when none holds blocks."""
        idle = [s for s in self.parked.values() if s.block_table] or [
            s for s in reversed(self.waiting) if s.block_table
        ]
        if not idle:
            return False
        self.block_manager.free(idle[0])
        self.num_reclaimed += 1
        return True

    def evict_all_kv(self) -> None:
        """Forget every cached K/V (after a weight load); sequences keep their tokens and re-prefill
        (parked ones when they are extended)."""
        for seq in list(self._holders()):
            self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        # Nothing runnable while sequences are running means every one of them is a prefill
        # stuck on blocks held by the others: preempt the newest until the oldest can proceed
        # (a sequence alone always fits, the engine checks max_model_len <= capacity).
        # Idle (parked) K/V goes first: also when nothing runs and a waiting sequence cannot fit.
        while True:
            batch = self._schedule_once()
            if len(batch) or not (self.running or self.waiting):
                return batch
            if self.reclaim_idle():
                continue
            if not self.running:
                return batch
            self._preempt(self.running[-1])

    def _schedule_once(self) -> ScheduledBatch:
        bm = self.block_manager
        batch = ScheduledBatch()
        decode: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.in_prefill:
                continue
            while not bm.can_grow(seq, len(seq)):
                if self.reclaim_idle():
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                bm.grow(seq, len(seq))
                decode.append(seq)
        # a victim may have been scheduled before it was preempted: keep only survivors
        decode = [s for s in decode if s.status is SequenceStatus.RUNNING]
        batch.seqs.extend(decode)
        batch.num_tokens.extend([1] * len(decode))
        batch.num_decode = len(decode)

        budget = self.prefill_chunk_tokens
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.in_prefill:
                continue
            n = min(seq.num_uncomputed, budget)
            while not bm.can_grow(seq, seq.num_computed + n) and self.reclaim_idle():
                pass
            if not bm.can_grow(seq, seq.num_computed + n):
                continue
            bm.grow(seq, seq.num_computed + n)
            if self.sharing:
                self.sharing.register(seq, seq.num_computed + n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            held = bool(seq.block_table)  # a resumed parked sequence: its K/V up to num_computed is cached
            shared = self.sharing.match_prefix(seq) if self.sharing and not held else []
            # < len(seq): at least the last prompt token (held: the last sampled one) is fed
            cached = seq.num_computed if held else len(shared) * bm.block_size
            n = min(len(seq) - cached, budget)
            reserve = self.watermark if self.running else 0
            if bm.blocks_needed(seq, cached + n) - len(shared) + reserve > bm.num_free:
                break
            self.waiting.popleft()
            if shared:
                self.sharing.share(seq, shared)
            bm.grow(seq, cached + n)
            if self.sharing:
                self.sharing.register(seq, cached + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch
