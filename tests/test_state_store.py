"""The checkpoint's tensor store: rows written by W ranks read back by W' ranks, names, shapes and
dtypes checked, and a crafted file refused with a one-line error (nothing is unpickled)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from staleflow.train.state_store import StateError, load_rank_state, read_full, read_index, row_range, write_rank_state


class RowShard:
    """Stands in for an FSDP2 DTensor on one rank: global shape, Shard(0), its own rows."""

    def __init__(self, full: torch.Tensor, rank: int, world: int):
        lo, hi = row_range(full.shape[0], rank, world)
        self.local = full[lo:hi].clone()
        self.shape, self.dtype, self.placements = full.shape, full.dtype, [Shard(0)]

    def to_local(self):
        return self.local


def _save(folder, full: dict, world: int) -> None:
    index = None
    for r in range(world):
        index = write_rank_state(
            folder, r, world, {k: RowShard(v, r, world) if v.dim() else v for k, v in full.items()}
        )
    (folder / "state.json").write_text(json.dumps(index))


@pytest.mark.parametrize("saved,loaded", [(3, 2), (2, 3), (1, 4), (4, 1)])
def test_rows_written_by_some_ranks_are_read_back_by_any_number(tmp_path, saved, loaded):
    g = torch.Generator().manual_seed(0)
    full = {
        "model/w": torch.randn(7, 3, generator=g),
        "model/b": torch.randn(5, generator=g).to(torch.bfloat16),
        "optim/w/step": torch.tensor(4.0),
        "model/tiny": torch.randn(2, 2, generator=g),
    }  # fewer rows than ranks
    _save(tmp_path, full, saved)
    for r in range(loaded):
        targets = {
            k: RowShard(torch.zeros_like(v), r, loaded) if v.dim() else torch.zeros_like(v) for k, v in full.items()
        }
        load_rank_state(tmp_path, r, loaded, targets)
        for k, v in full.items():
            want = v[slice(*row_range(v.shape[0], r, loaded))] if v.dim() else v
            got = targets[k].to_local() if v.dim() else targets[k]
            assert torch.equal(got, want), (k, r)
    for k, v in full.items():
        assert torch.equal(read_full(tmp_path, k), v)


def test_names_shapes_and_dtypes_must_match(tmp_path):
    _save(tmp_path, {"model/w": torch.ones(4, 2)}, 2)
    with pytest.raises(StateError, match="1 tensors missing"):
        load_rank_state(tmp_path, 0, 1, {"model/w": torch.zeros(4, 2), "model/v": torch.zeros(1)})
    with pytest.raises(StateError, match=r"model/w: stored F32 \[4, 2\], this run has F32 \[4, 3\]"):
        load_rank_state(tmp_path, 0, 1, {"model/w": torch.zeros(4, 3)})
    with pytest.raises(StateError, match="BF16"):
        load_rank_state(tmp_path, 0, 1, {"model/w": torch.zeros(4, 2, dtype=torch.bfloat16)})


def test_a_crafted_rank_file_is_refused_in_one_line(tmp_path):
    _save(tmp_path, {"model/w": torch.ones(4, 2)}, 1)
    f = tmp_path / "rank_0.safetensors"
    head = json.dumps({"model/w": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 1 << 40]}}).encode()
    f.write_bytes(len(head).to_bytes(8, "little") + head + b"\0" * 32)
    with pytest.raises(StateError, match="cannot be read as safetensors") as e:
        load_rank_state(tmp_path, 0, 1, {"model/w": torch.zeros(4, 2)})
    assert "\n" not in str(e.value)
    (tmp_path / "state.json").write_text("[1, 2")
    with pytest.raises(StateError, match="state.json is missing or unreadable"):
        read_index(tmp_path)
