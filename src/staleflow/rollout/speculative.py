"""Speculator: speculative decoding from group siblings in the built-in engine (``--rollout.speculative``).

Each step, for the decoding sequences (when there are at most ``max_batch`` of them):
1. **draft** (`plan`): a suffix match over the group's tokens (drafts.SuffixDrafter: the sequence's
   own prompt + response and its siblings' responses) proposes up to k tokens d_1..d_m, m capped by
   the sequence's adaptive length, what is left of max_new_tokens / max_model_len, and the KV blocks
   free (never preempting anyone for a draft). The draft is fed after the sequence's last token:
   one forward computes the target's logits z_0..z_m at all 1 + m positions (ModelRunner: a causal
   query block per sequence over its cache, any decode backend).
2. **verify** (`accept`): exact rejection sampling for a point-mass draft. Row i is sampled by the
   engine's own Sampler exactly as a plain decode would sample that output position
   (temperature / top-k / top-p, the same counter-based uniform of (seed, position)): x_i ~ p_i.
   The draft token d_{i+1} is accepted iff x_i == d_{i+1}, which happens with probability
   p_i(d_{i+1}); at the first rejection x_i is emitted, and it is distributed as p_i given
   x != d_{i+1}, i.e. p_i with d_{i+1} removed and renormalised (the residual max(p - q, 0) of a
   point mass q); when all m are accepted, x_m is the bonus token from z_m. So the emitted tokens
   are x_0..x_j (j the first rejection, or m): exactly what plain decoding samples with the same
   seed, one position at a time, since x_i's context equals the emitted prefix whenever x_i is
   used. Greedy rows: accept while the draft equals the argmax.
3. **roll back** (`rollback`): the K/V of the last token and the accepted drafts stay; the rejected
   positions are forgotten: num_computed = len - 1 (the newest token has no K/V yet, as after any
   decode), the blocks past the sequence's tokens go back (BlockManager.trim), a DecodeMirror row
   forgets them (clip). Nothing of a draft ever enters the payload before it is emitted, so the
   behaviour log-probs are the target's log_softmax(z_i / T)[x_i] of the emitted tokens, stamped
   with the engine's version, and an abort / weight load between steps sees an ordinary sequence.

Adaptive length (``adaptive``): a sequence's draft length is cut to 1 + the accepted count at a
rejection and grows by one after a full acceptance, up to ``draft_tokens``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from staleflow.rollout.drafts import SuffixDrafter
from staleflow.rollout.engine import EngineError

if TYPE_CHECKING:
    from staleflow.config.speculative import SpeculativeConfig
    from staleflow.rollout.block_manager import BlockManager
    from staleflow.rollout.scheduler import ScheduledBatch
    from staleflow.rollout.sequence import Sequence


class SpeculativeStats:
    """Counters since the engine started (bench_speculative.py reads them)."""

    def __init__(self):
        self.decode_rows = 0
        """Decoding sequence-steps (one sequence in one forward) with speculation enabled."""
        self.emitted = 0
        """Tokens those rows emitted (a plain decode row emits 1)."""
        self.drafted = 0
        self.accepted = 0
        self.by_batch: dict[int, list[int]] = {}
        """Decoding sequences in the step -> [rows, emitted]."""

    @property
    def accepted_per_forward(self) -> float:
        """Tokens emitted per sequence per forward (1.0 without speculation)."""
        return self.emitted / self.decode_rows if self.decode_rows else 1.0

    def as_dict(self) -> dict:
        return {
            "decode_rows": self.decode_rows,
            "emitted": self.emitted,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accepted_per_forward": round(self.accepted_per_forward, 4),
            "draft_acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "by_batch": {b: round(e / r, 4) for b, (r, e) in sorted(self.by_batch.items())},
        }


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, block_manager: BlockManager, max_model_len: int, watermark: int):
        self.cfg = cfg
        self.drafter = SuffixDrafter(cfg.min_match, cfg.max_match, cfg.siblings)
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.watermark = watermark
        self.length: dict[object, int] = {}
        """Adaptive draft length per request id."""
        self.stats = SpeculativeStats()

    def join(self, request_id, tokens) -> None:
        self.drafter.join(request_id, tokens)

    def leave(self, request_id) -> None:
        self.drafter.leave(request_id)
        self.length.pop(request_id, None)

    def plan(self, batch: ScheduledBatch) -> None:
        """Give the step's decoding sequences their drafts (seq.draft, batch.num_tokens) and KV slots."""
        nd = batch.num_decode
        if not nd or nd > self.cfg.max_batch:
            return
        bm = self.block_manager
        for i, seq in enumerate(batch.seqs[:nd]):
            n = len(seq)
            room = min(
                self.length.get(seq.request_id, self.cfg.draft_tokens),
                seq.params.max_new_tokens - seq.num_output - 1,
                self.max_model_len - n - 1,
            )
            draft = self.drafter.propose(seq.request_id, room) if room > 0 else []
            # slots for positions n .. n + m - 1 (the scheduler gave the one of n - 1)
            if draft and not bm.can_grow(seq, n + len(draft), reserve=self.watermark):
                draft = draft[: max(0, len(seq.block_table) * bm.block_size - n)]
            if draft:
                bm.grow(seq, n + len(draft))
                seq.draft = draft
                batch.num_tokens[i] = 1 + len(draft)

    def accept(self, seq: Sequence, tokens: list[int], logprobs: list[float]):
        """The tokens a decode row group emits: tokens[0..j], j the first i with tokens[i] != draft[i]
        (or len(draft)); tokens[i] was sampled from the target at the i-th fed position."""
        draft = seq.draft
        j = 0
        while j < len(draft) and tokens[j] == draft[j]:
            j += 1
        self.stats.drafted += len(draft)
        self.stats.accepted += j
        if draft and self.cfg.adaptive:
            k = self.length.get(seq.request_id, self.cfg.draft_tokens)
            self.length[seq.request_id] = min(self.cfg.draft_tokens, k + 1) if j == len(draft) else j + 1
        return tokens[: j + 1], logprobs[: j + 1]

    def emitted(self, n: int, batch_size: int) -> None:
        """A decode row appended n tokens (fewer than accept returned when one of them stopped the sequence)."""
        st = self.stats
        st.decode_rows += 1
        st.emitted += n
        row = st.by_batch.setdefault(batch_size, [0, 0])
        row[0] += 1
        row[1] += n

    def rollback(self, seqs: list[Sequence], mirror) -> None:
        """After the step's tokens were appended: forget the rejected drafts' K/V (see the module doc)."""
        for seq in seqs:
            if seq.draft:
                seq.num_computed = min(seq.num_computed, len(seq) - 1)
                self.block_manager.trim(seq, len(seq))
        if mirror is not None:
            mirror.clip()
        for seq in seqs:
            seq.draft = []


def make_speculator(
    cfg: SpeculativeConfig | None, cuda_graphs: bool, block_manager: BlockManager, max_model_len: int, watermark: int
) -> Speculator | None:
    """The engine's Speculator, None when speculation is off; refused in one line with CUDA graphs."""
    if cfg is None or not cfg.enabled:
        return None
    if cuda_graphs:
        raise EngineError(
            "--rollout.speculative.draft-tokens is refused with --rollout.cuda-graphs (a verification "
            "step feeds several tokens per sequence; captured steps feed one): drop one of the two flags"
        )
    return Speculator(cfg, block_manager, max_model_len, watermark)
