"""The audit behind scripts/chaos.py, without a launch: a group trained twice is found by its
content (whatever its ids), a buffer never trained is lost, and a chaos run whose fault never
happened is a failure, not a pass."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from staleflow.control.messages import StepDone, decode, encode
from staleflow.metrics.audit import audit_rows, content_digest

ROOT = Path(__file__).resolve().parents[1]


def _chaos():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "scripts" / "chaos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(steps: int = 3, batch: int = 2, group: int = 2):
    """trained.jsonl and metrics.jsonl rows of a clean run: fresh ids, prompts and tokens everywhere."""
    trained, traj, gid = [], 0, 0
    for b in range(steps):
        for _ in range(batch):
            ids = list(range(traj, traj + group))
            content = [content_digest([7, gid], [100 + t, 5]) for t in ids]
            trained.append(
                {"buffer": b, "group_id": gid, "traj_version": b, "traj_ids": ids, "prompt_id": gid, "content": content}
            )
            traj, gid = traj + group, gid + 1
    return trained, [{"step": b} for b in range(steps)]


def test_a_clean_run_passes():
    trained, metrics = _run()
    report = audit_rows(trained, metrics, 3, 2, 2, eta=1, require_content=True)
    assert report.ok, report.problems


def test_a_group_trained_twice_is_found_by_content_alone():
    """The same tokens trained again under new trajectory, group and prompt ids (what a buffer
    replayed after a resume would look like): only the content digests can tell."""
    trained, metrics = _run()
    again = dict(trained[1], buffer=2, group_id=99, traj_ids=[90, 91], prompt_id=99)
    trained[-1] = again  # buffer 2 still has 2 groups: no count gives it away
    report = audit_rows(trained, metrics, 3, 2, 2, eta=1, require_content=True)
    assert report.duplicated and not report.lost, report.problems
    assert any("group content" in p for p in report.duplicated)
    assert not any("trajectory 9" in p for p in report.duplicated)  # not found by ids


def test_one_trajectory_in_two_groups_is_found_by_content():
    trained, metrics = _run()
    trained[3] = dict(trained[3], content=[trained[3]["content"][0], trained[0]["content"][1]])
    report = audit_rows(trained, metrics, 3, 2, 2, eta=1, require_content=True)
    assert any("trajectory content" in p for p in report.duplicated), report.problems


def test_superseded_training_of_the_same_content_is_not_a_duplicate():
    """Rows written after the checkpoint a run resumed from do not count: the same prompt trained
    again after the resume (under new ids) is exactly-once training."""
    trained, metrics = _run()
    old = dict(trained[-1], group_id=50, traj_ids=[80, 81], superseded=True)
    report = audit_rows([*trained, old], metrics, 3, 2, 2, eta=1, require_content=True)
    assert report.ok, report.problems


def test_a_lost_buffer_and_a_missing_content_record_are_lost():
    trained, metrics = _run()
    report = audit_rows([r for r in trained if r["buffer"] != 1], metrics, 3, 2, 2, eta=1, require_content=True)
    assert any("never trained" in p for p in report.lost) and not report.duplicated, report.problems
    trained[0] = {k: v for k, v in trained[0].items() if k != "content"}
    report = audit_rows(trained, metrics, 3, 2, 2, eta=1, require_content=True)
    assert any("not recorded" in p for p in report.lost), report.problems


def test_a_prompt_trained_twice_is_found_by_its_prompt_id():
    trained, metrics = _run()
    trained[2] = dict(trained[2], prompt_id=trained[0]["prompt_id"])
    report = audit_rows(trained, metrics, 3, 2, 2, eta=1, require_content=True)
    assert any("prompt 0 trained twice" in p for p in report.duplicated), report.problems


def test_chaos_counts_a_run_without_its_fault_as_a_failure():
    chaos = _chaos()
    trained, metrics = _run()
    clean = audit_rows(trained, metrics, 3, 2, 2, eta=1, require_content=True)
    seen = dict(finished=True, hang=False, leaked=[], canary=False, wrong=[])
    assert not any(chaos.judge(clean, injected=True, **seen).values())
    counts = chaos.judge(clean, injected=False, **seen)
    assert counts["not_injected"] and sum(counts.values()) == 1
    planted = dict(trained[1], buffer=2, group_id=99, traj_ids=[90, 91], prompt_id=99)
    dup = audit_rows([*trained[:-1], planted], metrics, 3, 2, 2, eta=1, require_content=True)
    assert chaos.judge(dup, injected=True, **seen)["duplicated"]
    assert chaos.judge(clean, injected=True, **dict(seen, finished=False))["lost"]
    assert chaos.judge(clean, injected=True, **dict(seen, canary=True))["code_executed"]


def test_content_digests_ride_on_step_done():
    """The trainer's digests cross the control plane as they are (int group ids as keys)."""
    msg = StepDone(version=3, metrics={}, train_s=0.1, push_s=0.0, content={7: [content_digest([1], [2, 3])]})
    assert decode(encode(msg)) == msg
    assert content_digest([1, 2], [3]) != content_digest([1], [2, 3])
    assert content_digest([1], [2, 3]) == content_digest((1,), (2, 3))


@pytest.mark.scripts_smoke
def test_chaos_faults_py_has_an_injector_for_every_fault_kind():
    """scripts/chaos_faults.py (imported by chaos.py) injects every kind chaos.py promises an outcome for."""
    chaos = _chaos()
    faults = sys.modules["chaos_faults"]
    assert set(faults.SCENARIO) == set(chaos.FAULTS) and all(callable(f) for f in faults.SCENARIO.values())


@pytest.mark.scripts_smoke
def test_chaos_hostile_py_crafts_what_the_readers_refuse(tmp_path):
    """scripts/chaos_hostile.py: its five kinds are chaos.py kinds, and each crafted checkpoint value it
    writes (the manifest rewritten to match) is refused by verify_checkpoint without a launch."""
    from test_checkpoint_readers import make_checkpoint

    from staleflow.train.checkpoint import CheckpointError, verify_checkpoint

    chaos = _chaos()
    hostile = sys.modules["chaos_hostile"]
    assert set(hostile.HOSTILE) <= set(chaos.FAULTS) and len(hostile.HOSTILE) == 5
    for i, craft in enumerate(hostile.VALUE_CRAFTS.values()):
        ck = make_checkpoint(tmp_path / str(i) / "checkpoints", 4)
        verify_checkpoint(ck)
        craft(ck)
        with pytest.raises(CheckpointError):
            verify_checkpoint(ck)


@pytest.mark.scripts_smoke
def test_chaos_inputs_py_kinds_are_chaos_kinds_with_their_injectors():
    """scripts/chaos_inputs.py (issue 50's hostile inputs): every kind it injects is a chaos.py kind whose
    scenario is that injector, and chaos.py promises >= 24 kinds in all."""
    chaos = _chaos()
    inputs = sys.modules["chaos_inputs"]
    faults = sys.modules["chaos_faults"]
    assert len(inputs.INPUTS) >= 10 and set(inputs.INPUTS) <= set(chaos.FAULTS)
    assert all(faults.SCENARIO[kind] is fn for kind, fn in inputs.INPUTS.items())
    assert len(chaos.FAULTS) >= 24
