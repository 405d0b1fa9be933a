"""SuffixDrafter: draft tokens for speculative decoding from a GRPO group's own text (no draft model).

The N responses of a group answer the same prompt, so they repeat each other's phrases (and the
prompt's numbers and words). For a sequence about to decode, the drafter finds the longest suffix of
its context (prompt + response) of ``min_match``..``max_match`` tokens that occurred before in its
group - in its own prompt or response, or in a sibling's response, finished ones included - and
proposes the tokens that followed that occurrence:

    drafter = SuffixDrafter(min_match=2, max_match=8)
    drafter.join("g0-1", tokens_1)          # the engine's payload of each member (read, never changed)
    drafter.join("g0-2", tokens_2)          # same prompt ids: the same group
    drafter.propose("g0-2", 4)              # -> up to 4 token ids, [] without a match
    drafter.leave("g0-1")                   # finished / aborted: its text stays while the group lives

Siblings are the requests whose prompt ids are equal (``siblings=False``: every request is its own
group, only its own context is matched). The index is a dict from each n-gram to its latest
occurrence (the member and the position after it), filled incrementally as members' tokens grow: an
n-gram is entered only once a token follows it, so every hit has a continuation. A group's prompt is
indexed once. Each member keeps a flat copy of its context (an index view, not a payload) (responses are short next to the KV).
Pure Python on token ids: no torch, no I/O.
"""

from __future__ import annotations

from staleflow.tokens import TrajectoryTokens


class _Member:
    __slots__ = ("group", "source", "context", "indexed")

    def __init__(self, group: _Group, source: TrajectoryTokens, start: int):
        self.group = group
        self.source = source
        self.context: list[int] = list(source.prompt_ids) + list(source.response_ids)
        self.indexed = start
        """Positions before this have had the n-grams ending just before them entered."""


class _Group:
    __slots__ = ("key", "index", "live", "members")

    def __init__(self, key):
        self.key = key
        self.index: dict[tuple[int, ...], tuple[_Member, int]] = {}
        self.live = 0
        self.members: list[_Member] = []
        """Every member that joined while the group lived (finished ones' text still drafts)."""


class SuffixDrafter:
    def __init__(self, min_match: int = 2, max_match: int = 8, siblings: bool = True):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match, self.siblings = min_match, max_match, siblings
        self.groups: dict[object, _Group] = {}
        self.members: dict[object, _Member] = {}

    def join(self, request_id, tokens: TrajectoryTokens) -> None:
        """A request entered the engine (new, or resumed with its partial response)."""
        key = tuple(tokens.prompt_ids) if self.siblings else ("own", request_id)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = _Group(key)
            start = 1
        else:  # the prompt's n-grams are in the index already: only those reaching the response
            start = len(tokens.prompt_ids)
        member = _Member(group, tokens, start)
        group.members.append(member)
        group.live += 1
        self.members[request_id] = member
        self._index(member)

    def leave(self, request_id) -> None:
        """A request left the engine (finished, aborted, released); the group goes with its last member."""
        member = self.members.pop(request_id, None)
        if member is None:
            return
        self._sync(member)
        group = member.group
        group.live -= 1
        if group.live == 0:
            del self.groups[group.key]

    def propose(self, request_id, k: int) -> list[int]:
        """Up to k draft tokens continuing request_id's context (its group indexed up to date first)."""
        member = self.members.get(request_id)
        if member is None or k < 1:
            return []
        for m in member.group.members:
            self._sync(m)
        ctx, index = member.context, member.group.index
        for n in range(min(self.max_match, len(ctx)), self.min_match - 1, -1):
            hit = index.get(tuple(ctx[-n:]))
            if hit is not None:
                src, start = hit
                return src.context[start : start + k]
        return []

    def _sync(self, member: _Member) -> None:
        """Copy the member's new tokens (sampled ones, observations) and index them."""
        t = member.source
        have = len(member.context) - len(t.prompt_ids)
        if have < len(t.response_ids):
            member.context.extend(t.response_ids[have:])
            self._index(member)

    def _index(self, member: _Member) -> None:
        toks, index = member.context, member.group.index
        lo, hi = self.min_match, self.max_match
        for p in range(max(member.indexed, lo), len(toks)):  # n-grams ending at p - 1, continued at p
            for n in range(lo, min(hi, p) + 1):
                index[tuple(toks[p - n : p])] = (member, p)
        member.indexed = max(member.indexed, len(toks))
