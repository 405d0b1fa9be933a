"""Crafted checkpoint files (train/checkpoint_files.py): typed, range-checked, one CheckpointError naming
the file and field; a newer invalid checkpoint is skipped for the newest intact one (--resume and
`staleflow check --resume`); manifest names never leave their folder."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.train.checkpoint import CheckpointError, find_resume_checkpoint, verify_checkpoint
from staleflow.train.checkpoint_files import read_manifest, read_trainer_state


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def make_checkpoint(root: Path, version: int, state: dict | None = None, manifest_edit=None) -> Path:
    """A checkpoint folder with the files verify_checkpoint reads, its manifest matching them."""
    folder = root / f"step_{version:08d}"
    folder.mkdir(parents=True)
    files = {
        "rank_0.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
        "state.json": json.dumps({"world": 1, "tensors": {}}).encode(),
        "trainer_state.json": json.dumps(
            state
            or {
                "version": version,
                "world": 1,
                "optimizer_steps": version,
                "scheduler": {"last_epoch": version},
                "extra": {"version": version, "next_traj": 40, "next_group": 10, "counts": {"late_records": 1}},
            }
        ).encode(),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    manifest = {
        "version": version,
        "world": 1,
        "files": {n: {"size": len(d), "sha256": _sha(d)} for n, d in files.items()},
    }
    if manifest_edit:
        manifest_edit(folder, manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _rehash(folder: Path, manifest: dict, name: str) -> None:
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": _sha(data)}


def test_fuzz_reader_a_valid_checkpoint_verifies(tmp_path):
    folder = make_checkpoint(tmp_path, 4)
    assert verify_checkpoint(folder)["version"] == 4
    assert read_trainer_state(folder).optimizer_steps == 4


def _huge_version(folder, manifest):
    state = json.loads((folder / "trainer_state.json").read_text())
    state["version"] = 10**20
    (folder / "trainer_state.json").write_text(json.dumps(state))
    _rehash(folder, manifest, "trainer_state.json")


def _other_version(folder, manifest):
    state = json.loads((folder / "trainer_state.json").read_text())
    state["version"] = state["extra"]["version"] = 3
    (folder / "trainer_state.json").write_text(json.dumps(state))
    _rehash(folder, manifest, "trainer_state.json")


def _outside(name: str):
    def edit(folder, manifest):
        target = (folder / name) if not name.startswith("/") else Path(name)
        if not name.startswith("/"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("outside")
        data = target.read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": _sha(data)}

    return edit


def _symlink_out(folder, manifest):
    outside = folder.parent.parent / "secret.txt"
    outside.write_text("secret")
    (folder / "link.bin").symlink_to(outside)
    manifest["files"]["link.bin"] = {"size": 6, "sha256": _sha(b"secret")}


CRAFTED = {
    "version 10**20 (rehashed)": _huge_version,
    "version differs from the folder name": _other_version,
    "manifest version 10**20": lambda f, m: m.update(version=10**20),
    "files entry a number": lambda f, m: m["files"].update({"state.json": 7}),
    "files entry a list": lambda f, m: m["files"].update({"state.json": [1, 2]}),
    "files entry null": lambda f, m: m["files"].update({"state.json": None}),
    "files a list": lambda f, m: m.update(files=[1]),
    "size a string": lambda f, m: m["files"]["state.json"].update(size="12"),
    "sha256 a number": lambda f, m: m["files"]["state.json"].update(sha256=5),
    "path ../../../../outside.txt": _outside("../../../../outside.txt"),
    "absolute path /etc/hostname": _outside("/etc/hostname"),
    "a symlink out of the folder": _symlink_out,
    "trainer_state not covered": lambda f, m: m["files"].pop("trainer_state.json"),
}


@pytest.mark.parametrize("kind", sorted(CRAFTED))
def test_crafted_checkpoint_is_refused_in_one_line_and_resume_falls_back(tmp_path, kind):
    if kind.startswith("absolute") and not Path("/etc/hostname").is_file():
        pytest.skip("no /etc/hostname here")
    root = tmp_path / "run" / "checkpoints"
    older = make_checkpoint(root, 2)
    newer = make_checkpoint(root, 4, manifest_edit=CRAFTED[kind])
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(newer)
    msg = str(info.value)
    assert "\n" not in msg and str(newer) in msg and older.name in msg, msg
    chosen, warnings = find_resume_checkpoint(root)
    assert chosen == older and any(newer.name in w for w in warnings)


def test_crafted_extra_fields_are_refused(tmp_path):
    base = {"version": 4, "world": 1, "optimizer_steps": 4, "scheduler": {}}
    for extra in (
        {"next_traj": -1},
        {"next_group": "10"},
        {"counts": {"x": 1.5}},
        {"data": {"offset": 10**30}},
        {"requeue": [{"prompt_id": 1}]},
        {"requeue": [{"prompt_id": 1, "text": "t", "answer": "a", "prompt_ids": [2**40], "meta": {}}]},
        {"version": 3},
    ):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        folder = make_checkpoint(root, 4, state={**base, "extra": extra})
        with pytest.raises(CheckpointError, match="extra"):
            verify_checkpoint(folder)


def test_check_resume_falls_back_past_a_crafted_newer_checkpoint(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run / "checkpoints", 2)
    make_checkpoint(run / "checkpoints", 4, manifest_edit=CRAFTED["files entry null"])
    res = subprocess.run(
        [sys.executable, "-m", "staleflow", "check", "--preset", "tiny", "--resume", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target=st.sampled_from(["manifest.json", "trainer_state.json"]),
    path=st.lists(st.sampled_from(["version", "world", "files", "state.json", "size", "sha256", "extra"]), max_size=3),
    value=_JSON,
    raw=st.none() | st.binary(max_size=64),
)
def test_fuzz_reader_checkpoint_json(tmp_path_factory, target, path, value, raw):
    """Any value at any place (or random bytes for the whole file): verified, or one CheckpointError."""
    folder = make_checkpoint(tmp_path_factory.mktemp("ck"), 4)
    file = folder / target
    if raw is not None:
        file.write_bytes(raw)
    else:
        obj = json.loads(file.read_text())
        node = obj
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and path:
            node[path[-1]] = value
        elif not path:
            obj = value
        file.write_text(json.dumps(obj))
    if target == "trainer_state.json":  # rehash so that the decoding, not the digest, is what is tested
        manifest = json.loads((folder / "manifest.json").read_text())
        _rehash(folder, manifest, target)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    try:
        verify_checkpoint(folder)
        read_manifest(folder)
    except CheckpointError as e:
        assert "\n" not in str(e)


def test_crafted_scheduler_fields_are_refused_and_other_torch_bookkeeping_accepted():
    from staleflow.train.checkpoint_files import check_scheduler

    live = {"base_lrs": [0.001], "last_epoch": 0, "_step_count": 1, "_is_initial": False, "lr_lambdas": [None]}
    where = Path("trainer_state.json")
    check_scheduler(dict(live), live, where)
    check_scheduler({k: v for k, v in live.items() if k != "_is_initial"}, live, where)  # an older torch's
    check_scheduler({**live, "_new_flag": True}, live, where)  # a newer torch's private scalar
    for bad in ({"optimizer": "x"}, {"last_epoch": "3"}, {"base_lrs": [1.0, 2.0]}, {"__class__": 1}, {"_x": [1]}):
        with pytest.raises(CheckpointError, match="scheduler"):
            check_scheduler({**live, **bad}, live, where)
