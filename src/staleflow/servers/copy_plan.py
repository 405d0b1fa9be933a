"""The copies of one pull: a slot's views into a reader's tensors, merged where both sides are adjacent.

    pairs = copy_pairs(layout.entries, rows, slot_views, out)   # [(src, dst), ...]
    for src, dst in pairs:
        dst.copy_(src)

The Parameter Server layout puts the members of a fused group (q|k|v, gate|up of a layer) next to
each other without padding (layout.py), and the built-in engine's parameters are row blocks of one
contiguous matrix per group in the same order (``CausalLM.fuse_projections``). A run of entries
whose source views are adjacent in one piece AND whose destinations are adjacent in one storage
is therefore one contiguous range on both sides: it is copied with ONE copy (a memcpy on CUDA),
not one per parameter. Nothing is merged across dtypes, devices or gaps, so the merge never
changes which bytes land where; a destination that is not contiguous (another engine's own
layout) is copied as it is.
"""

from __future__ import annotations

import torch


def span(first: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements of ``first``'s storage, starting where ``first`` starts."""
    out = torch.empty(0, dtype=first.dtype, device=first.device)
    return out.set_(first.untyped_storage(), first.storage_offset(), (numel,))


def follows(prev: torch.Tensor, nxt: torch.Tensor) -> bool:
    """``nxt`` starts where the contiguous ``prev`` ends, in the same storage, with its dtype."""
    return (
        prev.dtype == nxt.dtype
        and prev.device == nxt.device
        and prev.is_contiguous()
        and nxt.is_contiguous()
        and prev.untyped_storage().data_ptr() == nxt.untyped_storage().data_ptr()
        and prev.data_ptr() + prev.numel() * prev.element_size() == nxt.data_ptr()
    )


def copy_pairs(entries, rows: dict[str, list[tuple[int, int]]], views: list[dict], out: dict) -> list:
    """(source, destination) pairs that copy every entry named in ``out`` from the pieces' ``views``
    (``rows[name][p]``: rows [a, b) of the parameter held by piece p; None: a piece held on another
    node, not copied here), merging adjacent runs."""
    pairs = []
    for p, piece in enumerate(views):
        if piece is None:
            continue
        run: list[tuple[torch.Tensor, torch.Tensor]] = []
        for e in entries:
            dst_full = out.get(e.name)
            if dst_full is None:
                continue
            a, b = rows[e.name][p]
            if b <= a:
                continue
            src = piece[e.name]
            dst = dst_full if dst_full.dim() == 0 else dst_full[a:b]
            if run and follows(run[-1][0], src) and follows(run[-1][1], dst):
                run.append((src, dst))
                continue
            pairs.extend(_merged(run))
            run = [(src, dst)]
        pairs.extend(_merged(run))
    return pairs


def _merged(run: list) -> list:
    if len(run) <= 1:
        return run
    n = sum(s.numel() for s, _ in run)
    return [(span(run[0][0], n), span(run[0][1], n))]
