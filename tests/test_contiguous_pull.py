"""Pulls as contiguous copies (issue 27, item 1): the Parameter Server layout equals the engine's.

The built-in engine's parameters are row blocks of one contiguous [out, in] matrix per fused
group (q|k|v, gate|up), and the slot layout puts those groups' members next to each other in the
same order: every slot view has the shape and strides of the engine tensor it is copied into, and
a one-piece pull copies each fused matrix with ONE copy (no strided or transposed views).
"""

from __future__ import annotations

import uuid

import pytest
import torch

from staleflow.model import CausalLM, ModelArgs
from staleflow.rollout.builtin_engine import BuiltinEngine
from staleflow.servers import ParameterServer, ParamLayout
from staleflow.servers.copy_plan import copy_pairs
from staleflow.servers.layout import fused_group, piece_rows
from staleflow.servers.weights import LocalWeights

ARGS = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


def _trainer_model(arch: str, seed: int) -> CausalLM:
    return CausalLM(ModelArgs(architecture=arch, **ARGS)).init_weights(std=0.1, seed=seed)


def _engine(arch: str, seed: int) -> BuiltinEngine:
    return BuiltinEngine(_trainer_model(arch, seed), max_running=2, max_kv_tokens=64, block_size=8, max_model_len=32)


def _engine_tensors(engine) -> int:
    """Distinct storages of the engine's parameters: one per fused matrix, one per other tensor."""
    return len({p.untyped_storage().data_ptr() for p in engine.model.parameters()})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_contiguous_pull_one_copy_per_engine_tensor(arch):
    run = "c" + uuid.uuid4().hex[:10]
    trainer = dict(_trainer_model(arch, 1).named_parameters())  # the trainer's unfused HF tensors
    engine = _engine(arch, 2)
    targets = engine.weight_targets()
    assert all(t.is_contiguous() for t in targets.values()), "engine parameters are plain row blocks"
    ps = ParameterServer.create(run, ParamLayout.from_named_tensors(trainer))
    source = LocalWeights(run, reader=0)
    try:
        ps.begin_push(1)
        for name, t in trainer.items():
            ps.write_shard(name, t.detach())
        ps.publish(1)
        # the slot views the engine reads are laid out exactly as its parameters
        views = ps.slots[[sl.header()[1] for sl in ps.slots].index(1)].views[0]
        for name, t in targets.items():
            assert views[name].shape == t.shape and views[name].stride() == t.stride(), name
            assert views[name].is_contiguous()
        assert source.load(engine, keep_kv=False)[0] == 1
        got = dict(engine.model.named_parameters())
        assert all(torch.equal(got[k], v) for k, v in trainer.items())
        assert source.ps.last_copies == _engine_tensors(engine)  # q|k|v, (their biases), gate|up: one each
        assert source.ps.last_copies < len(targets)
        fused = sum(1 for n in targets if fused_group(n))
        assert len(targets) - source.ps.last_copies == fused - len(
            {fused_group(n)[0] for n in targets if fused_group(n)}
        )
    finally:
        source.close()
        ps.close()


def test_contiguous_pull_layout_packs_fused_groups_in_engine_order():
    """qwen2's state dict interleaves q.weight, q.bias, k.weight, ...; the layout regroups them."""
    trainer = _trainer_model("qwen2", 0)
    layout = ParamLayout.from_named_tensors(trainer.named_parameters())
    names = layout.names()
    i = names.index("model.layers.0.self_attn.q_proj.weight")
    assert names[i : i + 3] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    j = names.index("model.layers.0.self_attn.q_proj.bias")
    assert names[j : j + 3] == [f"model.layers.0.self_attn.{x}_proj.bias" for x in "qkv"]
    idx = layout.index()
    q, k = idx[names[i]], idx[names[i + 1]]
    assert k.offset == q.offset + q.nbytes  # no padding inside a group
    assert all(e.offset % layout.align == 0 for e in layout.entries if fused_group(e.name) is None)
    assert sorted(names) == sorted(n for n, _ in trainer.named_parameters())


@pytest.mark.parametrize("pieces", [2, 3])
def test_contiguous_pull_pieces_copy_every_row_once_and_merge_nothing_across_pieces(pieces):
    """A split slot (one piece per trainer GPU): each piece's rows land in the right rows; copies
    are merged only where both sides are adjacent (never across the rows of other pieces)."""
    trainer = dict(_trainer_model("llama", 3).named_parameters())
    layout = ParamLayout.from_named_tensors(trainer)
    split = layout.split(pieces)
    views = []
    for p, lay in enumerate(split):
        v = lay.views(torch.zeros(lay.nbytes, dtype=torch.uint8))
        for name, t in trainer.items():
            a, b = piece_rows(tuple(t.shape), pieces, p)
            if b > a:
                v[name].copy_(t.detach()[a:b])
        views.append(v)
    rows = {e.name: [piece_rows(e.shape, pieces, p) for p in range(pieces)] for e in layout.entries}
    engine = _engine("llama", 4)
    out = engine.weight_targets()
    pairs = copy_pairs(layout.entries, rows, views, out)
    for src, dst in pairs:
        dst.copy_(src)
    got = dict(engine.model.named_parameters())
    assert all(torch.equal(got[k], v) for k, v in trainer.items())
    held = sum(1 for name in out for p in range(pieces) if rows[name][p][1] > rows[name][p][0])
    assert len(pairs) <= held
    assert all(s.is_contiguous() and d.is_contiguous() for s, d in pairs)


def test_contiguous_pull_gpu_pieces_are_mapped_on_the_readers_own_device(monkeypatch):
    """A rollout rank maps every GPU piece on ITS device (copies then run on its stream); a reader
    that names no device maps them on their owners. CUDA IPC is replaced by CPU tensors here."""
    import staleflow.servers.pieces as pieces

    registry, opened = {}, []

    def create(name, nbytes, device, readers):
        registry[name] = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
        return registry[name], [f"{name}/{i}".encode() for i in range(readers)], "GPU-fake"

    def open_(name, blob, uuid_, map_on=None):
        opened.append(map_on)
        return registry[name]

    monkeypatch.setattr(pieces, "cuda_piece_create", create)
    monkeypatch.setattr(pieces, "cuda_piece_open", open_)
    monkeypatch.setattr(pieces, "cuda_piece_release", lambda name: registry.pop(name, None))
    trainer = dict(_trainer_model("llama", 5).named_parameters())
    run = "g" + uuid.uuid4().hex[:10]
    layout = ParamLayout.from_named_tensors(trainer)
    owners = [ParameterServer.create(run, layout, device="cuda:0", pieces=2, readers=3)]
    owners.append(ParameterServer.attach(run, piece=1, device="cuda:1"))
    readers = []
    try:
        readers.append(ParameterServer.attach(run, reader=1, device="cuda:2"))
        assert opened and all(d == torch.device("cuda:2") for d in opened)
        opened.clear()
        readers.append(ParameterServer.attach(run, reader=2))
        assert opened and all(d is None for d in opened)
        for ps in owners:
            ps.begin_push(1)
        for r, ps in enumerate(owners):
            for name, t in trainer.items():
                a, b = piece_rows(tuple(t.shape), 2, r)
                row = t[0].numel() if t.dim() else 1
                if b > a:
                    ps.write_shard(name, t.detach().reshape(-1)[a * row : b * row], a * row)
            ps.end_push()
        owners[0].publish(1)
        engine = _engine("llama", 6)
        readers[0].pull(1, out=engine.weight_targets())
        got = dict(engine.model.named_parameters())
        assert all(torch.equal(got[k], v) for k, v in trainer.items())
    finally:
        for ps in readers + owners[::-1]:
            ps.close()
