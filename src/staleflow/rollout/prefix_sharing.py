"""SharingBlockManager: the N members of a GRPO group compute their common prompt's K/V once.

The N responses of a group start from the same prompt, and without sharing every one of them
prefills it: N times the prompt's GEMMs and N copies of its K/V. Here a prompt's full blocks
are computed by the first member admitted and then referenced by the others. Matching is by
prefix, block by block, so prompts that only start alike (a common system header) share their
common full blocks too; only blocks some live sequence holds can be matched (no cache of
finished sequences' blocks):

- blocks are reference counted; a block returns to the free list when its last holder frees it;
- a full prompt block is *registered* under the key (parent block id, its block_size token
  ids) in the step whose feed completes it. The parent block id stands for the whole prefix
  before it: it is unique while the block is live, and a block's holders also hold all blocks
  before it, so a parent is never freed before its children and a key never outlives the content
  it describes;
- an admitted sequence looks its leading prompt blocks up in that chain, takes a reference on
  each match and starts its prefill after them (`num_computed` = the shared tokens). A block
  registered earlier in the same step is safe to share: PagedAttention writes the step's K/V of
  every fed token into the cache before any attention of that layer reads it;
- only blocks that end before the last prompt token are shared, so every member still feeds at
  least one token (its logits give the first sample) and owns every block from its first
  partial one on: all writes after admission go to blocks with a single holder, no copy-on-write;
- freeing (finish, abort, preemption) drops references; a weight load frees every running
  sequence's blocks (`Scheduler.evict_all_kv`), so no K/V of the old weights can be matched. A
  load with keep_kv (in-flight sequences keep their old-weight K/V) calls `retire_prefixes`
  instead: every block held at that moment leaves the prefix table and may never be registered
  again while it lives, so a request admitted after the load computes its prompt afresh.
`stats()` counts the prompt tokens whose prefill sharing saved.
"""

from __future__ import annotations

from staleflow.rollout.block_manager import BlockManager
from staleflow.rollout.sequence import Sequence


class SharingBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.ref_count = [0] * num_blocks
        self.prefix_blocks: dict[tuple[int, tuple[int, ...]], int] = {}
        """(parent block or -1, token ids of the block) -> the live block holding their K/V."""
        self.block_key: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.shared_tokens = 0
        """Prompt tokens admitted with their K/V already cached (prefill computation saved)."""
        self.stale: set[int] = set()
        """Held blocks whose K/V predate a keep_kv weight load: never (re-)registered."""

    def shareable_blocks(self, seq: Sequence) -> int:
        """Leading blocks that may be shared: full prompt blocks ending before the last prompt token."""
        return (seq.num_prompt - 1) // self.block_size

    def _key(self, seq: Sequence, j: int, parent: int) -> tuple[int, tuple[int, ...]]:
        bs = self.block_size
        return parent, tuple(seq.token_slice(j * bs, (j + 1) * bs))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks holding seq's leading shareable prompt blocks (may be empty)."""
        blocks: list[int] = []
        parent = -1
        for j in range(self.shareable_blocks(seq)):
            blk = self.prefix_blocks.get(self._key(seq, j, parent))
            if blk is None:
                break
            blocks.append(blk)
            parent = blk
        return blocks

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Give a sequence without blocks references on `blocks` (from match_prefix); their
        tokens count as computed."""
        assert not seq.block_table and seq.num_computed == 0, "share() needs a sequence without cached K/V"
        for b in blocks:
            self.ref_count[b] += 1
        seq.block_table = list(blocks)
        seq.num_computed = len(blocks) * self.block_size
        self.shared_tokens += seq.num_computed

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        start = len(seq.block_table)
        super().grow(seq, num_tokens)
        for b in seq.block_table[start:]:
            self.ref_count[b] = 1

    def register(self, seq: Sequence, num_tokens: int) -> None:
        """Publish seq's shareable blocks that its first num_tokens tokens fill (call when this
        step feeds them, after grow)."""
        table = seq.block_table
        for j in range(min(self.shareable_blocks(seq), num_tokens // self.block_size)):
            blk = table[j]
            if blk in self.stale:
                break  # old weights' K/V: neither it nor anything after it may be shared
            if blk in self.block_key:
                continue
            parent = table[j - 1] if j else -1
            if j and parent not in self.block_key:
                break  # the prefix before it is not reachable in the chain
            key = self._key(seq, j, parent)
            if key not in self.prefix_blocks:  # else another live block already holds this content
                self.prefix_blocks[key] = blk
                self.block_key[blk] = key

    def retire_prefixes(self) -> None:
        """After a weight load that keeps in-flight K/V: nothing cached so far may be matched."""
        self.stale.update(b for b, c in enumerate(self.ref_count) if c)
        self.prefix_blocks.clear()
        self.block_key.clear()

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference on each block (free, trim); blocks nobody holds go back to the free
        list (unregistered)."""
        released = []
        for b in blocks:
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                key = self.block_key.pop(b, None)
                if key is not None:
                    del self.prefix_blocks[key]
                self.stale.discard(b)
                released.append(b)
        self.free_blocks.extend(released)

    def check(self, seqs) -> None:
        """Assert the bookkeeping against the live sequences (tests): each block's count equals
        the number of tables holding it, counted + free blocks are all blocks, and every
        registered block is held."""
        counts = [0] * self.num_blocks
        for s in seqs:
            for b in s.block_table:
                counts[b] += 1
        assert counts == self.ref_count, "reference counts differ from the block tables"
        held = {b for b, c in enumerate(counts) if c}
        assert sorted(held | set(self.free_blocks)) == list(range(self.num_blocks)), "a block was lost"
        assert not held & set(self.free_blocks) and len(set(self.free_blocks)) == len(self.free_blocks), (
            "a held block is on the free list"
        )
        assert set(self.block_key) <= held and {v: k for k, v in self.prefix_blocks.items()} == self.block_key
        assert self.stale <= held and not self.stale & set(self.block_key), "a stale block is shareable"
