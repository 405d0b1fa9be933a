"""BlockManager: the paged KV cache's bookkeeping (which fixed-size block belongs to whom).

The cache is `num_blocks` blocks of `block_size` token slots; a sequence's block table maps its
token i to slot `block_table[i // block_size] * block_size + i % block_size`. Blocks are taken
from a free list as a sequence grows and all returned at finish, abort or preemption, so the
used count goes back to its initial level. No prefix sharing (rollout prompts of one GRPO
group could share, but interruption and resume make reference counts a liability).
"""

from __future__ import annotations

from staleflow.rollout.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # a stack: freed blocks are reused first, so on CPU the pages touched (resident memory)
        # track the peak use rather than creeping over the whole cache
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks for `seq` to hold its first `num_tokens` tokens."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_tokens) + reserve <= len(self.free_blocks)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq's block table to cover `num_tokens` tokens (caller checked can_grow)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"KV cache out of blocks: need {need}, free {len(self.free_blocks)}")
        for _ in range(need):
            seq.block_table.append(self.free_blocks.pop())

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks; its cached K/V is gone (num_computed = 0)."""
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.kv_epoch += 1

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Return the blocks past seq's first `num_tokens` tokens (a speculative step's rejected draft
        positions); the K/V of the positions kept stays valid."""
        keep = -(-num_tokens // self.block_size)
        if len(seq.block_table) > keep:
            self._release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _release(self, blocks: list[int]) -> None:
        self.free_blocks.extend(blocks)

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
