"""Trainer ranks on several nodes.

The trainer itself, under `torchrun --nproc_per_node=4` on gloo (this file is its own worker, like
test_train_distributed): FSDP over all four ranks and HSDP over two "nodes" of two (shard within a row
of the mesh, replicate across rows) each train the same two steps as one unsharded rank, within float
tolerance; HSDP's replicas hold equal shards, its checkpoint holds one state file per shard (written by
the first replica), names every file's node, and reloads on one rank.

The runtime, with two torchrun agents on this machine (two nodes: node identity is torchrun's): trainer
ranks 0-1 on node 0 and 2 on node 1, the rollout rank on node 1. It trains; the rollout instance pulls
node 1's piece from shared memory and node 0's from its owner over gloo (bytes per node in metrics.jsonl
and printed); every file of a checkpoint is named with its node; and the first step's loss equals that
of the same trainer world on one node, on the same data (--mode sync: the same batch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_helpers import assert_same, lipschitz_adam, random_batch, tiny_model  # noqa: E402

from staleflow.config import TrainConfig  # noqa: E402
from staleflow.train.trainer import Trainer  # noqa: E402

CFG = dict(lr=1e-2, micro_batch_tokens=20, loss_agg="seq-mean", off_policy="tis-token", grad_clip=0.3)
ROWS = ((0, 1), (2, 3))  # HSDP: two nodes of two trainer ranks


def _batches():
    return random_batch(seed=41, groups=6), random_batch(seed=42, groups=6)


@pytest.mark.slow
def test_multinode_trainer_fsdp_and_hsdp_across_nodes_match_one_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STALEFLOW_TEST_OUT": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)

    one = Trainer(tiny_model(seed=30), TrainConfig(**CFG))  # the same two steps on one unsharded rank
    lipschitz_adam(one)
    a, b = _batches()
    m1, m2 = one.step(*a), one.step(*b)
    full = one.full_state_dict()
    for kind in ("fsdp", "hsdp"):
        for k in ("loss", "grad_norm", "entropy_mean"):
            assert got[kind]["metrics"][0][k] == pytest.approx(m1[k], rel=1e-5), (kind, k)
            assert got[kind]["metrics"][1][k] == pytest.approx(m2[k], rel=1e-5), (kind, k)
        assert_same(got[kind]["full"], full, atol=1e-5)

    # HSDP: both replicas hold the same rows of every parameter; the rows tile the full tensor
    shards = [torch.load(tmp_path / f"hsdp_shards{r}.pt", weights_only=False) for r in range(4)]
    for r in (0, 1):
        for s, t in zip(shards[r], shards[r + 2], strict=True):
            assert (s.name, s.row_offset) == (t.name, t.row_offset) and torch.equal(s.local, t.local)
    for name, ref in got["hsdp"]["full"].items():
        name = name.removeprefix("lm.")
        pieces = sorted((s for r in (0, 1) for s in shards[r] if s.name == name), key=lambda s: s.row_offset)
        if pieces:
            torch.testing.assert_close(torch.cat([s.local for s in pieces]), ref, atol=0, rtol=0)

    # the HSDP checkpoint: one state file per shard (the first replica's), every rank's RNG, files by node
    ckpt = tmp_path / "ckpt" / "step_00000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert (manifest["nodes"], manifest["sharding"], manifest["world"]) == (2, "hsdp", 4)
    states = sorted(f for f in manifest["files"] if f.startswith("rank_"))
    assert states == ["rank_0.safetensors", "rank_1.safetensors"]
    assert {f: e["node"] for f, e in manifest["files"].items() if f.startswith("rng_") and f.endswith("json")} == {
        "rng_0.json": 0,
        "rng_1.json": 0,
        "rng_2.json": 1,
        "rng_3.json": 1,
    }
    from staleflow.train.checkpoint import load_checkpoint
    from staleflow.train.checkpoint_files import reshard_note

    r = Trainer(tiny_model(seed=99), TrainConfig(**CFG))
    lipschitz_adam(r)
    load_checkpoint(r, ckpt)  # resharded: one rank reads every shard's rows
    assert r.version == 2
    assert_same(r.full_state_dict(), got["hsdp"]["full"], atol=0)
    assert reshard_note(ckpt, r, nodes=1) == (
        "checkpoint step_00000002 was written by 4 trainer rank(s) on 2 node(s) (hsdp); resharded onto "
        "1 rank(s) on 1 node(s) (fsdp)"
    )
    c = random_batch(seed=43, groups=6)
    assert r.step(*c)["loss"] == pytest.approx(one.step(*c)["loss"], rel=1e-5)


def _worker():
    import torch.distributed as dist

    from staleflow.train.parallelize import Replicas

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(os.environ["STALEFLOW_TEST_OUT"])
    shard = [dist.new_group(list(row)) for row in ROWS]
    columns = [dist.new_group(list(col)) for col in zip(*ROWS)]
    replicas = Replicas(ROWS, shard[rank // 2], columns[rank % 2])
    got = {}
    for kind in ("fsdp", "hsdp"):
        t = Trainer(
            tiny_model(seed=30),
            TrainConfig(**CFG),
            process_group=dist.group.WORLD,
            replicas=replicas if kind == "hsdp" else None,
        )
        lipschitz_adam(t)
        a, b = _batches()
        metrics = [t.step(*a), t.step(*b)]
        got[kind] = {"metrics": metrics, "full": t.full_state_dict()}
        kinds = {tuple(type(x).__name__ for x in p.placements) for p in t.model.parameters()}
        assert kinds == ({("Replicate", "Shard")} if kind == "hsdp" else {("Shard",)}), kinds
        if kind == "hsdp":
            assert (t.replica, t.shard_rank, t.shard_world) == (rank // 2, rank % 2, 2)
            torch.save(list(t.named_shards()), out / f"hsdp_shards{rank}.pt")
            from staleflow.train.checkpoint import begin_save, finish_save
            from staleflow.train.checkpoint_writer import CheckpointWriter

            final, writer = begin_save(t, out / "ckpt", writer=CheckpointWriter(copy=False), node=rank // 2, nodes=2)
            finish_save(t, writer, final)
    if rank == 0:
        torch.save(got, out / "rank0.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()  # no interpreter shutdown: see test_train_distributed
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker()
