"""Reward models (--reward.model): a tiny random Hugging Face sequence classifier made here with
transformers and the SmolLM2 tokenizer (chat template included) scores (prompt, response) pairs
in batches, in processes of its own, alone or weighted with a rule; its failures go through the
reward-error path (each key once, score 0, one line); folders that could run code are refused;
the memory plan counts it; 2-step runs with a working and with a failing reward model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import uuid

import pytest
import torch

from staleflow.config import RewardConfig
from staleflow.reward import RewardError
from staleflow.reward.model_pool import check_device
from staleflow.reward.model_scorer import RewardModelScorer, check_reward_model_folder
from staleflow.reward.service import RewardService

transformers = pytest.importorskip("transformers")


def make_reward_model(folder, kind: str = "llama", seed: int = 0, **config) -> str:
    """A random one-label sequence classifier over the SmolLM2 tokenizer, saved as safetensors."""
    from staleflow.model.aliases import ensure_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(str(ensure_tokenizer()))
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            num_labels=1,
            pad_token_id=tok.eos_token_id,
            **config,
        )
        model = transformers.LlamaForSequenceClassification(cfg)
    else:  # gpt2 with 8 positions: every longer input fails inside the forward (IndexError)
        cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=8, num_labels=1)
        model = transformers.GPT2ForSequenceClassification(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
    return make_reward_model(tmp_path_factory.mktemp("rm"))


PAIRS = [
    ("What is 2 + 3?", "It is \\boxed{5}."),
    ("Name a colour.", "Blue"),
    ("What is 7 * 6?", "42, I think, because seven sixes are forty-two."),
    ("Say nothing.", ""),
]


def test_reward_model_batched_scores_equal_one_at_a_time_transformers(rm_folder):
    scorer = RewardModelScorer(rm_folder)
    batched = scorer.score([p for p, _ in PAIRS], [r for _, r in PAIRS])
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(rm_folder)
    for (p, r), got in zip(PAIRS, batched):
        text = tok.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
        )
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            want = ref(input_ids=ids).logits[0, 0].item()  # one sequence, no padding: the last token
        assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(s, 6) for s in batched)) == len(PAIRS)  # random but not constant
    # a pair longer than --reward.model-max-tokens keeps its end (the classifier reads the last token)
    long = RewardModelScorer(rm_folder, max_tokens=12)
    ids = long.encode(["x " * 50], ["the end"])[0]
    assert len(ids) == 12 and ids == scorer.encode(["x " * 50], ["the end"])[0][-12:]


def test_reward_model_folders_that_cannot_run_or_would_run_code_are_refused(tmp_path, rm_folder):
    from staleflow.model import save_hf
    from staleflow.model.args import ModelArgs
    from staleflow.model.transformer import CausalLM

    lm = save_hf(CausalLM(ModelArgs(vocab_size=64)), tmp_path / "lm")
    with pytest.raises(RewardError, match="ForSequenceClassification"):
        check_reward_model_folder(str(lm))
    with pytest.raises(RewardError, match="no such folder"):
        check_reward_model_folder(str(tmp_path / "missing"))
    for name, edit, why in (
        ("remote", lambda c: c | {"auto_map": {"AutoModelForSequenceClassification": "x.Y"}}, "auto_map"),
        ("labels", lambda c: c | {"num_labels": 2, "id2label": {"0": "a", "1": "b"}}, "2 labels"),
    ):
        bad = shutil.copytree(rm_folder, tmp_path / name)
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(edit(config)))
        with pytest.raises(RewardError, match=why):
            check_reward_model_folder(str(bad))
    pickled = shutil.copytree(rm_folder, tmp_path / "pickled")
    for f in pickled.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(RewardError, match="safetensors"):
        check_reward_model_folder(str(pickled))


def test_reward_model_device_is_never_a_trainer_gpu_unless_asked():
    check_device("cpu", {0}, False, 0)
    check_device("cuda:1", {0}, False, 2)
    with pytest.raises(RewardError, match="trainer rank's GPU"):
        check_device("cuda:0", {0}, False, 2)
    check_device("cuda:0", {0}, True, 2)
    with pytest.raises(RewardError, match="has 2 GPUs"):
        check_device("cuda:2", set(), False, 2)
    with pytest.raises(Exception, match="reward.model-device"):
        RewardConfig(model="x", model_device="gpu0")


def test_reward_model_pool_scores_every_key_once_in_batches(rm_folder):
    cfg = RewardConfig(model=rm_folder, model_batch_size=3, timeout_s=60)
    want = RewardModelScorer(rm_folder).score([p for p, _ in PAIRS], [r for _, r in PAIRS])
    with RewardService(dataclasses.replace(cfg, rule_weight=0.0)) as svc:
        assert svc.rule is None  # the model alone: no rule workers
        for i in range(3):
            for k, (p, r) in enumerate(PAIRS):
                svc.submit((i, k), r, "", {}, prompt=p)
        got = svc.drain(timeout=120)
        assert sorted(k for k, _, _ in got) == sorted((i, k) for i in range(3) for k in range(4))
        for (_, k), reward, info in got:
            assert reward == pytest.approx(want[k], abs=1e-5) and "error" not in info
        assert svc.model.counters["batches"] < 12 and svc.pending() == 0


def test_reward_model_weighted_with_a_rule(rm_folder):
    cfg = RewardConfig(fn="arithmetic", model=rm_folder, model_weight=0.5, rule_weight=2.0, workers=1, timeout_s=60)
    score = RewardModelScorer(rm_folder).score(["What is 2 + 3?"] * 2, ["\\boxed{5}", "\\boxed{6}"])
    with RewardService(cfg) as svc:
        svc.submit("right", "\\boxed{5}", "5", {}, prompt="What is 2 + 3?")
        svc.submit("wrong", "\\boxed{6}", "5", {}, prompt="What is 2 + 3?")
        got = {k: (r, info) for k, r, info in svc.drain(timeout=120)}
    assert got["right"][0] == pytest.approx(2.0 * 1.0 + 0.5 * score[0], abs=1e-5)
    assert got["wrong"][0] == pytest.approx(0.5 * score[1], abs=1e-5)
    assert got["right"][1]["rule_reward"] == 1.0 and got["right"][1]["model_score"] == pytest.approx(score[0], abs=1e-5)


def test_reward_model_failures_score_zero_with_the_error_and_a_broken_model_stops_in_one_line(tmp_path):
    failing = make_reward_model(tmp_path / "gpt2", kind="gpt2")
    cfg = RewardConfig(model=failing, rule_weight=0.0, timeout_s=60)
    with RewardService(cfg) as svc:
        for k, (p, r) in enumerate(PAIRS[:3]):
            svc.submit(k, r, "", {}, prompt=p)
        got = svc.drain(timeout=120)
    assert sorted(k for k, _, _ in got) == [0, 1, 2]
    assert all(r == 0.0 and info["error"].startswith("reward model: IndexError") for _, r, info in got)
    broken = shutil.copytree(make_reward_model(tmp_path / "rm"), tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config | {"hidden_size": 48}))  # weights are 32 wide
    with RewardService(RewardConfig(model=str(broken), rule_weight=0.0)) as svc:
        svc.submit(0, "x", "", {}, prompt="y")
        with pytest.raises(RewardError, match="cannot run") as e:
            svc.drain(timeout=120)
    assert "\n" not in str(e.value)


def test_reward_model_memory_is_planned(rm_folder):
    from staleflow.plan import build_plan
    from staleflow.plan.report import summary, table
    from staleflow.presets import preset_tiny

    base = preset_tiny()
    cpu = build_plan(dataclasses.replace(base, reward=RewardConfig(model=rm_folder)), 3, 80 << 30)
    rm = [rp for rp in cpu.ranks if rp.role == "reward"]
    assert len(rm) == 1 and rm[0].gpu is None and rm[0].items["weights"] == 1591488 * 4  # fp32 on cpu
    assert "rm0" in table(cpu) and summary(cpu)["reward_model_gib"] > 0
    gpu = RewardConfig(model=rm_folder, model_device="cuda:2", model_workers=2, model_share_trainer_gpu=True)
    plan = build_plan(dataclasses.replace(base, reward=gpu), 3, 80 << 30)
    without = build_plan(base, 3, 80 << 30)
    extra = plan.per_gpu[2] - without.per_gpu[2]
    assert extra == sum(rp.peak for rp in plan.ranks if rp.role == "reward") > 2 * 1591488 * 2  # two bf16 copies


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_reward_model_two_step_run(tmp_path, kind):
    from test_launch import TORCHRUN, _kill_group

    folder = make_reward_model(tmp_path / "rm", kind=kind)
    tag = uuid.uuid4().hex
    env = dict(os.environ, STALEFLOW_TEST_TAG=tag)
    cmd = [*TORCHRUN, "-m", "staleflow", "train", "--preset", "tiny", "--steps", "2", "--reward.model", folder]
    cmd += ["--reward.rule-weight", "0", "--reward.max-consecutive-failures", "4", "--log.run-dir", str(tmp_path)]
    cmd += ["--log.name", "run", "--log.no-progress"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        _kill_group(proc)
    if kind == "llama":  # trains on the reward model's scores
        assert proc.returncode == 0, out[-4000:]
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]
        assert [r["step"] for r in rows] == [0, 1] and all(r["bound_violations"] == 0 for r in rows)
        assert not any(r.get("reward_first_error") for r in rows)
        assert len({round(r["reward_mean"], 6) for r in rows}) == 2  # real-valued scores, not a rule's 0/1
    else:  # every call fails: the run stops in one line through the reward-error path, no hang
        assert proc.returncode != 0
        lines = [line for line in out.splitlines() if "reward calls in a row failed" in line]
        assert lines and "reward model: IndexError" in lines[0], out[-3000:]
