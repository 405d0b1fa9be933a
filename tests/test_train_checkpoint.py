"""Checkpoints: kill during a save then resume == uninterrupted run; corruption detected; HF export loads in transformers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_helpers import random_batch, tiny_model  # noqa: E402

from staleflow.config import TrainConfig  # noqa: E402
from staleflow.model import PackedAttention, cu_seqlens_from_lengths, packed_positions  # noqa: E402
from staleflow.train import checkpoint as ck  # noqa: E402
from staleflow.train.trainer import Trainer  # noqa: E402

CFG = dict(lr=1e-2, micro_batch_tokens=24, warmup_steps=2, schedule="cosine")


def _trainer(seed=0):
    return Trainer(tiny_model(seed=seed), TrainConfig(**CFG), total_steps=10)


def _batches():
    return [random_batch(seed=30 + i, groups=3) for i in range(4)]


def _killed_run(out: Path) -> None:
    """Subprocess body: 2 steps, save, 1 step, then SIGKILL in the middle of the next save."""
    t = _trainer()
    b = _batches()
    t.step(*b[0])
    t.step(*b[1])
    ck.save_checkpoint(t, out, extra={"queue": [1, 2, 3]}, keep=2)
    t.step(*b[2])

    def die(path):  # after the shards and trainer state are written, before the manifest
        os.kill(os.getpid(), signal.SIGKILL)

    ck._sha256 = die
    ck.save_checkpoint(t, out, keep=2)


def test_kill_during_save_then_resume_equals_uninterrupted(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (tmp_path / ".tmp-step_00000003").is_dir()  # the torn save is left behind, not used
    latest = ck.latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step_00000002"

    b = _batches()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the killed run: bitwise equality needs the same reduction splits
    try:
        ref = _trainer()
        for x in b[:2]:
            ref.step(*x)
        m3, m4 = ref.step(*b[2]), ref.step(*b[3])

        resumed = _trainer(seed=123)  # different initial weights: everything must come from the checkpoint
        assert ck.load_checkpoint(resumed, latest) == {"queue": [1, 2, 3]}
        assert resumed.version == 2
        r3, r4 = resumed.step(*b[2]), resumed.step(*b[3])
    finally:
        torch.set_num_threads(threads)
    for a, r in ((m3, r3), (m4, r4)):
        assert r["loss"] == a["loss"] and r["lr"] == a["lr"] and r["grad_norm"] == a["grad_norm"]
    w_ref, w_res = ref.full_state_dict(), resumed.full_state_dict()
    for k in w_ref:
        torch.testing.assert_close(w_res[k], w_ref[k], atol=0, rtol=0)


def test_corrupted_checkpoint_is_detected_and_previous_one_stays(tmp_path):
    t = _trainer()
    b = _batches()
    paths = []
    for i in range(3):
        t.step(*b[i])
        paths.append(ck.save_checkpoint(t, tmp_path, keep=2))
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]

    shard = paths[-1] / "rank_0.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh = _trainer(seed=7)
    with pytest.raises(
        ck.CheckpointError, match=r"step_00000003 is corrupted: rank_0.safetensors.*step_00000002 is intact"
    ):
        ck.load_checkpoint(fresh, paths[-1])
    ck.load_checkpoint(fresh, paths[-2])
    assert fresh.version == 2

    (paths[-2] / ck.MANIFEST).unlink()  # a folder without its manifest is partial
    with pytest.raises(ck.CheckpointError, match="partial"):
        ck.load_checkpoint(fresh, paths[-2])
    assert ck.latest_checkpoint(tmp_path) == paths[-1]


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen3", False)])
def test_exported_policy_loads_in_transformers_with_identical_logits(tmp_path, arch, tied):
    from transformers import AutoModelForCausalLM

    t = Trainer(tiny_model(seed=4, arch=arch, tied=tied), TrainConfig(lr=1e-2))
    t.step(*random_batch(seed=5, groups=2))  # export trained weights, not the init
    ck.export_hf(t, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0].float()
        cu = cu_seqlens_from_lengths([len(ids)])
        ours = t.model.compute_logits(t.model(ids, packed_positions(cu), PackedAttention(cu)))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    _killed_run(Path(sys.argv[1]))


def test_policy_weights_load_from_a_checkpoint_without_a_trainer(tmp_path):
    t = _trainer()
    start = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.step(*_batches()[0])
    path = ck.save_checkpoint(t, tmp_path, keep=1)
    fresh = tiny_model(seed=0)
    ck.load_policy_weights(fresh, path)
    trained = t.model.state_dict()
    assert all(torch.equal(fresh.state_dict()[k], trained[k]) for k in trained)
    assert any(not torch.equal(start[k], trained[k]) for k in trained)  # the step moved the weights


class _Payload:
    """Unpickling this runs a command: what a crafted checkpoint would carry."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/staleflow-pwned",))


def _reseal(path: Path) -> None:
    """What an attacker who can write the folder also does: rewrite the manifest to match."""
    files = {
        str(f.relative_to(path)): {"size": f.stat().st_size, "sha256": ck._sha256(f)}
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != ck.MANIFEST
    }
    (path / ck.MANIFEST).write_text(json.dumps({"version": 0, "world": 1, "files": files}))


def test_a_checkpoint_holds_only_safetensors_and_json(tmp_path):
    """No file of a checkpoint is a pickle: every one is a safetensors file (8-byte length, JSON
    header) or JSON, so loading one parses data and never runs code."""
    t = _trainer()
    t.step(*_batches()[0])
    path = ck.save_checkpoint(t, tmp_path, keep=1)
    names = sorted(f.name for f in path.iterdir())
    assert names == [
        "manifest.json",
        "rank_0.safetensors",
        "rng_0.json",
        "rng_0.safetensors",
        "state.json",
        "trainer_state.json",
    ]
    for f in path.iterdir():
        data = f.read_bytes()
        if f.suffix == ".json":
            json.loads(data)
        else:
            n = int.from_bytes(data[:8], "little")
            assert json.loads(data[8 : 8 + n])["__metadata__"] == {"format": "pt"}
        assert not data.startswith(b"\x80")  # a pickle protocol 2+ stream starts with PROTO


def test_a_pickle_planted_in_a_checkpoint_runs_no_code(tmp_path):
    """A DCP-style .metadata pickle (what torch's DCP would unpickle) and a torch.save'd payload in
    place of the generator state, with the manifest rewritten to match: refused, no code runs."""
    t = _trainer()
    path = ck.save_checkpoint(t, tmp_path, keep=1)
    marker = Path("/tmp/staleflow-pwned")
    marker.unlink(missing_ok=True)
    import pickle

    (path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    (path / "state.json").unlink()
    _reseal(path)
    with pytest.raises(ck.CheckpointError, match="DCP format .* refused"):
        ck.load_checkpoint(_trainer(), path)
    with pytest.raises(ck.CheckpointError, match="DCP format .* refused"):
        ck.load_policy_weights(tiny_model(seed=0), path)
    assert not marker.exists()

    path = ck.save_checkpoint(t, tmp_path / "b", keep=1)
    torch.save({"torch": _Payload()}, path / "rng_0.safetensors")
    with pytest.raises(ck.CheckpointError, match="rng_0.safetensors does not match"):  # the manifest catches it
        ck.load_checkpoint(_trainer(), path)
    _reseal(path)
    with pytest.raises(ck.CheckpointError, match="unreadable random-generator state"):
        ck.load_checkpoint(_trainer(), path)
    assert not marker.exists()


def test_a_checkpoint_of_another_shape_is_refused_by_name(tmp_path):
    t = _trainer()
    path = ck.save_checkpoint(t, tmp_path, keep=1)
    index = json.loads((path / "state.json").read_text())
    name = next(k for k, e in index["tensors"].items() if k.startswith("model/") and len(e["shape"]) == 2)
    index["tensors"][name]["shape"][0] += 1
    (path / "state.json").write_text(json.dumps(index))
    _reseal(path)
    with pytest.raises(ck.CheckpointError, match=f"{name}: stored F32"):
        ck.load_checkpoint(_trainer(), path)
    index["tensors"][name]["shape"][0] -= 1
    index["tensors"]["model/extra.weight"] = {"shape": [2], "dtype": "F32", "sharded": False}
    (path / "state.json").write_text(json.dumps(index))
    _reseal(path)
    with pytest.raises(ck.CheckpointError, match="1 unexpected"):
        ck.load_checkpoint(_trainer(), path)


def test_a_failed_save_removes_its_temporary_folder_and_names_a_full_disk(tmp_path, monkeypatch):
    import errno

    t = _trainer()
    first = ck.save_checkpoint(t, tmp_path, keep=2)
    t.step(*_batches()[0])

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "write_safetensors", full)
    with pytest.raises(ck.CheckpointError, match="disk is full"):
        ck.save_checkpoint(t, tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no .tmp- folder left behind
    assert ck.find_resume_checkpoint(tmp_path)[0] == first


def test_resume_skips_a_damaged_newest_checkpoint_loudly(tmp_path):
    t = _trainer()
    b = _batches()
    t.step(*b[0])
    ck.save_checkpoint(t, tmp_path, keep=3)
    t.step(*b[1])
    newest = ck.save_checkpoint(t, tmp_path, keep=3)
    (newest / "manifest.json").unlink()
    path, warns = ck.find_resume_checkpoint(tmp_path)
    assert path.name == "step_00000001"
    assert any("skipping checkpoint step_00000002" in w and "no manifest" in w for w in warns)
    assert any("trained again" in w for w in warns)
    assert ck.find_resume_checkpoint(tmp_path / "none") == (None, [])
