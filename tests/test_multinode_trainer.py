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
of the same trainer world on one node, on the same data (--mode sync: the same batch; one test, so
that the two-node run is launched once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
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


def _one_node(tag: str, run_dir: Path, name: str, *args: str, nproc: int = 4) -> subprocess.Popen:
    """The same run with every rank under one torchrun agent (one node)."""
    from test_multinode_e2e import TINY, _free_port

    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")) if p)
    cmd = [
        *(sys.executable, "-m", "staleflow.launch.torchrun", "--nnodes", "1", "--nproc-per-node", str(nproc)),
        *("--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())),
        *("-m", "staleflow", "train", *TINY, "--log.run-dir", str(run_dir), "--log.name", name, *args),
    ]
    env = dict(os.environ, STALEFLOW_TEST_TAG=tag, PYTHONPATH=path)
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )


@pytest.mark.slow
def test_multinode_trainer_ranks_on_both_nodes_train_pull_each_piece_from_its_node_and_match_one_node(tmp_path):
    """2 agents x 2 ranks: trainer ranks 0, 1 on node 0 and 2 on node 1 (one FSDP2 group), rollout rank 3
    on node 1 (--rollout.ranks 1). Each node holds its trainer ranks' Parameter Server piece. Then the
    same trainer world (3 ranks) on one node, on the same data: --mode sync (every step waits for its
    batch: the same groups whatever the timing), so the first step's loss and gradient are equal (they
    come before the step's update: the one-node run's single step has another LR schedule, which does
    not enter)."""
    from test_faults import _leaked, _shm
    from test_launch import _wait_gone
    from test_multinode_e2e import _rows, agents, finish

    from staleflow.metrics.audit import audit_run

    tag, shm_before = uuid.uuid4().hex, _shm()
    args = ("--mode", "sync", "--rollout.ranks", "1")
    procs = agents(tag, tmp_path, "run", "--steps", "4", *args, launcher="staleflow.launch.torchrun")
    out0, out1 = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], out0[-3000:] + out1[-3000:]
    assert (
        "staleflow: 4 ranks on 2 nodes (3 trainer, 1 rollout); controller on node 0" in out0
        and "trainers (FSDP over all) and Parameter Server pieces on nodes 0, 1" in out0
    ), out0[-3000:]
    assert "node 1 [127.0.0.1]: rank 2 trainer, rank 3 rollout 0" in out0
    run = tmp_path / "run"
    rows = [r for r in _rows(run) if "eval_n" not in r]
    last = rows[-1]
    assert last["step"] == 3
    # every pull took node 0's piece (trainer ranks 0-1's rows) over gloo and node 1's (rank 2's) from
    # shared memory (versions 1-3, at least): the bytes by node are those of the pieces, 2 : 1 of the rows
    from staleflow.cluster.placement import slot_placement
    from staleflow.cluster.roles import Roles
    from staleflow.cluster.topology import Topology
    from staleflow.model import lazy_model
    from staleflow.servers import ParamLayout

    model, _ = lazy_model("tiny-llama")
    layout = ParamLayout.from_named_tensors(model.named_parameters(), dtype=torch.float32)
    topo = Topology.from_ranks(Roles(4, 1), [0, 0, 1, 1], [0, 1, 0, 1])
    want = slot_placement(topo, "cpu").bytes_by_node(layout, node=1, puller=3)
    by_node = {int(k): v for k, v in last["pull_bytes_by_node"].items()}
    pulls = by_node[0] // want[0]
    assert pulls >= 3 and by_node == {n: pulls * b for n, b in want.items()}, (by_node, want)
    assert last["cross_node_pull_bytes"] == by_node[0] and last["cross_node_records"] > 0
    assert f"weights pulled from each node's Parameter Server pieces: node 0: {by_node[0] / 1e6:.1f} MB" in out0
    assert audit_run(run, steps=4, batch_size=4, group_size=4, eta=1).ok
    # the checkpoint: every rank's shards, each named with the node that wrote it
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert (manifest["nodes"], manifest["world"], manifest["sharding"]) == (2, 3, "fsdp")
    assert {f: e["node"] for f, e in manifest["files"].items() if f.startswith("rank_")} == {
        "rank_0.safetensors": 0,
        "rank_1.safetensors": 0,
        "rank_2.safetensors": 1,
    }
    assert _wait_gone(tag) == []
    assert _leaked(shm_before) == set()  # both nodes' slots, rings and mirrors removed

    one = finish([_one_node(tag, tmp_path, "one", "--steps", "1", "--checkpoint.every", "0", *args)])
    assert "(3 trainer, 1 rollout); controller and Parameter Server on node 0" in one[0], one[0][-3000:]
    a = [r for r in _rows(tmp_path / "one") if "eval_n" not in r][0]
    assert a["step"] == rows[0]["step"] == 0
    a, b = a["train"], rows[0]["train"]
    assert (a["samples"], a["response_tokens"], a["reward_mean"]) == (
        b["samples"],
        b["response_tokens"],
        b["reward_mean"],
    )
    for key in ("loss", "grad_norm", "logp_mean", "entropy_mean", "advantage_abs_mean"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key  # the step's gradient: grad_norm
    assert _wait_gone(tag) == []


def test_multinode_trainer_refuses_a_run_folder_another_node_does_not_share(tmp_path):
    """A trainer rank off node 0 writes its checkpoint shards into rank 0's run folder: it must see that
    folder (rank 0's lock in it), else the run stops in one line naming --log.run-dir."""
    from staleflow.faults import ConfigError
    from staleflow.runfolder.lock import check_visible, lock_run_dir, release_run_dir

    run = tmp_path / "run"
    for seen in (run, tmp_path / "empty"):  # missing on this node; a folder of that name without the lock
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(ConfigError) as e:
            check_visible(str(seen), home=0, node=1)
        said = str(e.value)
        assert "\n" not in said and f"{seen} (made on node 0) is not visible on node 1" in said
        assert "--log.run-dir" in said
    run.mkdir()
    lock_run_dir(str(run))
    try:
        check_visible(str(run), home=0, node=1)  # the run's own folder (a shared file system): passes
    finally:
        release_run_dir(str(run))
