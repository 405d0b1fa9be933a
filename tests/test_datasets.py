"""Data sources as people have them (issue 39): a verl-format parquet, a save_to_disk folder, a JSON
file, a Hugging Face name missing from the local cache; chat-message prompts rendered with the
model's own chat template; system prompt and template for string prompts; weighted mixes; the
readers under fuzzing (a valid prompt or a one-line bad-row report, never another exception);
and two training steps of the tiny preset end to end on a verl parquet and on a save_to_disk folder."""

from __future__ import annotations

import json
import math
import os
import subprocess
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.config import DataConfig
from staleflow.data import DataError, PromptSource
from staleflow.data.files import check_record, read_rows
from staleflow.model import load_tokenizer
from staleflow.model.aliases import ensure_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(ensure_tokenizer()))


def verl_rows(n: int, source: str = "openai/gsm8k") -> list[dict]:
    """Rows laid out as verl's data preprocessing writes them (examples/data_preprocess/gsm8k.py)."""
    return [
        {
            "data_source": source,
            "prompt": [
                {"role": "system", "content": "You are a careful solver."},
                {"role": "user", "content": f"What is {i} + {i}? Put the final answer in \\boxed{{}}."},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def write_verl_parquet(path, n=12, source="openai/gsm8k"):
    pq.write_table(pa.Table.from_pylist(verl_rows(n, source)), str(path))
    return str(path)


def write_disk(path, n=12):
    rows = [{"question": f"What is {i} times 3?", "solution": str(3 * i)} for i in range(n)]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:2])}
    ).save_to_disk(str(path))
    return str(path)


# ---- formats -----------------------------------------------------------------------------------


def test_verl_format_parquet_loads_without_flags_and_renders_with_the_chat_template(tmp_path, tok):
    path = write_verl_parquet(tmp_path / "train.parquet")
    source = PromptSource(DataConfig(source=path), tok)
    assert len(source.rows) == 12 and source.bad_rows == []
    p = next(source)
    i = p.meta["extra_info"]["index"]
    assert p.answer == str(2 * i) and p.meta["data_source"] == "openai/gsm8k"
    expected = tok.apply_chat_template(
        [
            {"role": "system", "content": "You are a careful solver."},
            {"role": "user", "content": f"What is {i} + {i}? Put the final answer in \\boxed{{}}."},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert p.prompt_ids == tok(expected, add_special_tokens=False)["input_ids"]


def test_chat_prompt_needs_the_template_and_bad_messages_are_bad_rows(tmp_path, tok):
    path = write_verl_parquet(tmp_path / "train.parquet", n=4)
    with pytest.raises(DataError, match="needs the tokenizer's chat template: drop --data.no-chat-template"):
        PromptSource(DataConfig(source=path, chat_template=False), tok)
    cfg = DataConfig()
    assert check_record({"prompt": [], "answer": "1"}, cfg)[0] == "not_string"
    assert check_record({"prompt": [{"role": "user"}], "answer": "1"}, cfg)[0] == "not_string"
    assert check_record({"prompt": [{"role": "user", "content": " "}], "answer": "1"}, cfg)[0] == "not_string"
    assert check_record({"prompt": 3, "answer": "1"}, cfg)[0] == "not_string"


def test_chat_prompt_system_prompt_and_template_wrap_string_prompts(tmp_path, tok):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": 4}) + "\n")
    cfg = DataConfig(
        source=str(path), system_prompt="Be brief.", prompt_template="{prompt} Put the final answer in \\boxed{}."
    )
    p = next(PromptSource(cfg, tok))
    text = tok.decode(p.prompt_ids)
    assert "Be brief." in text and "What is 2 + 2? Put the final answer in \\boxed{}." in text
    assert p.text == "What is 2 + 2?" and p.answer == "4"
    raw = next(PromptSource(DataConfig(source=str(path), chat_template=False, prompt_template="Q: {prompt}"), tok))
    assert tok.decode(raw.prompt_ids, skip_special_tokens=True).strip() == "Q: What is 2 + 2?"


def test_datasets_save_to_disk_folder_split_and_dotted_fields(tmp_path, tok):
    folder = write_disk(tmp_path / "ds")
    source = PromptSource(DataConfig(source=folder, prompt_field="question"), tok)
    assert len(source.rows) == 12 and {r.answer for r in source.rows} == {str(3 * i) for i in range(12)}
    assert len(PromptSource(DataConfig(source=folder, prompt_field="question", split="test"), tok).rows) == 2
    with pytest.raises(DataError, match=r"has splits \['test', 'train'\], not --data.split='dev'"):
        PromptSource(DataConfig(source=folder, prompt_field="question", split="dev"), tok)
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps([{"extra": {"q": f"Say {i}."}, "label": {"a": i}} for i in range(3)]))
    rows, bad, _ = read_rows(str(nested), DataConfig(prompt_field="extra.q", answer_field="label.a"))
    assert [(r.text, r.answer) for r in rows] == [(f"Say {i}.", str(i)) for i in range(3)] and bad == []


def test_datasets_hub_name_missing_from_the_cache_says_how_to_fetch(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    with pytest.raises(DataError) as e:
        PromptSource(DataConfig(source="someorg/not-cached-set"), tok)
    msg = str(e.value)
    assert "\n" not in msg and "huggingface-cli download --repo-type dataset someorg/not-cached-set" in msg
    assert "save_to_disk" in msg


def test_datasets_hub_name_from_the_hub_cache_snapshot(tmp_path, tok, monkeypatch):
    """What `huggingface-cli download --repo-type dataset acme/tiny-math` leaves in the hub cache
    (refs/main -> snapshots/<commit>/data/*.parquet) loads offline by name."""
    import huggingface_hub.constants

    home = tmp_path / "hf"
    repo = home / "hub" / "datasets--acme--tiny-math"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "data").mkdir(parents=True)
    write_verl_parquet(repo / "snapshots" / commit / "data" / "train-00000-of-00001.parquet", n=6)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(home / "datasets"))
    source = PromptSource(DataConfig(source="acme/tiny-math"), tok)
    assert len(source.rows) == 6 and source.rows[0].meta["data_source"] == "openai/gsm8k"
    with pytest.raises(DataError, match="Unknown split.*set --data.split"):
        PromptSource(DataConfig(source="acme/tiny-math", split="dev"), tok)


def test_datasets_folder_not_written_by_save_to_disk_and_corrupt_parquet(tmp_path, tok):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not one written by datasets' save_to_disk"):
        PromptSource(DataConfig(source=str(tmp_path / "plain")), tok)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet PAR1")
    with pytest.raises(DataError, match="cannot be read") as e:
        PromptSource(DataConfig(source=str(bad)), tok)
    assert "\n" not in str(e.value)


def test_datasets_jsonl_deep_nesting_and_invalid_utf8_are_bad_rows(tmp_path, tok):
    path = tmp_path / "rows.jsonl"
    good = json.dumps({"prompt": "Say 1.", "answer": "1"}).encode()
    bad_utf8 = b'{"prompt": "Say \xff.", "answer": "2"}'
    surrogate = b'{"prompt": "Say \\ud800.", "answer": "3"}'  # valid JSON, not encodable text (found by fuzzing)
    path.write_bytes(b"\n".join([good, b"[" * 100_000, bad_utf8, surrogate, good]) + b"\n")
    rows, bad, _ = read_rows(str(path), DataConfig())
    assert len(rows) == 2
    assert [(b.location, b.kind) for b in bad] == [
        (f"{path}:2", "invalid_json"),
        (f"{path}:3", "invalid_utf8"),
        (f"{path}:4", "invalid_utf8"),
    ]
    assert "nested too deeply" in bad[0].reason and "\ufffd" not in "".join(r.text for r in rows)


# ---- mixes -------------------------------------------------------------------------------------


def test_data_mix_draws_follow_the_weights_and_resume_the_same(tmp_path, tok):
    a = write_verl_parquet(tmp_path / "a.parquet", n=40, source="a")
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"prompt": f"B question {i}?", "answer": i}) + "\n" for i in range(40)))
    cfg = DataConfig(mix=f"{a}:0.7,{b}:0.3", seed=3)
    source = PromptSource(cfg, tok)
    held = source.hold_out(10)
    assert sorted(p.meta["mix_source"] for p in held) == [a] * 7 + [str(b)] * 3
    n = 3000
    drawn = source.take(n)
    k = sum(p.meta["mix_source"] == a for p in drawn)
    # The draw is a pure function of (seed, prompt id): this count never changes between runs. The
    # bound is 6 binomial standard deviations, so a correct sampler passes for any seed.
    assert abs(k - 0.7 * n) <= 6 * math.sqrt(n * 0.7 * 0.3), k
    assert all((p.meta["mix_source"] == a) == ("reward_model" in p.meta) for p in drawn)
    assert not {p.text for p in held} & {p.text for p in drawn}  # held-out rows are never trained on
    again = PromptSource(cfg, tok)
    again.hold_out(10)
    again.take(1234)
    state = again.state_dict()
    resumed = PromptSource(cfg, tok)
    resumed.hold_out(10)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [p.text for p in resumed.take(50)] == [p.text for p in drawn[1234:1284]]


def test_data_mix_bad_spec_names_the_flag():
    from staleflow.config import ConfigError

    for spec in ("a.parquet", "a.parquet:0", "a.parquet:x", "a:1,:2"):
        with pytest.raises(ConfigError, match="--data.mix="):
            DataConfig(mix=spec)


# ---- fuzzing the readers -----------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ROW = st.fixed_dictionaries(
    {},
    optional={
        "prompt": JSON_VALUES
        | st.text(max_size=30)
        | st.lists(st.fixed_dictionaries({"role": st.text(max_size=6), "content": st.text(max_size=20)}), max_size=3),
        "answer": JSON_VALUES,
        "reward_model": st.fixed_dictionaries({}, optional={"ground_truth": JSON_VALUES}),
    },
)


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, byte in edits:
        if out:
            out[pos % len(out)] = byte
    return bytes(out)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(ROW | JSON_VALUES, min_size=1, max_size=6),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
    junk=st.lists(st.binary(max_size=40), max_size=3),
    depth=st.integers(0, 3000),
)
def test_fuzz_reader_jsonl_gives_prompts_or_one_line_bad_rows(tmp_path_factory, tok, rows, edits, junk, depth):
    path = tmp_path_factory.mktemp("fuzz") / "rows.jsonl"
    lines = [json.dumps(r).encode() for r in rows] + [b.replace(b"\n", b" ") for b in junk] + [b"[" * depth]
    path.write_bytes(_mutate(b"\n".join(lines), edits))
    good, bad, _ = read_rows(str(path), DataConfig())
    for b in bad:
        assert b.location.startswith(f"{path}:") and "\n" not in b.reason
    for r in good:
        assert isinstance(r.answer, str) and r.answer.strip() and r.text.strip()
    try:
        source = PromptSource(DataConfig(source=str(path)), tok)
    except DataError as e:
        assert "\n" not in str(e) and not good or "too_long" in str(e) or "tokens" in str(e), e
        return
    p = next(source)
    assert p.prompt_ids and p.answer.strip()


@settings(max_examples=200, deadline=None)
@given(rec=ROW | JSON_VALUES)
def test_fuzz_reader_records_of_any_shape_are_rows_or_one_line_reasons(rec):
    """What datasets hands over from a parquet / json / arrow source: any nested value."""
    for cfg in (DataConfig(), DataConfig(prompt_field="a.b", answer_field="reward_model.ground_truth")):
        got = check_record(rec, cfg)
        if isinstance(got, tuple):
            kind, reason = got
            assert kind in ("not_object", "missing_field", "not_string", "empty") and "\n" not in reason
        else:
            assert got.text.strip() and got.answer.strip()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 100_000), st.integers(0, 255)), min_size=1, max_size=4))
def test_fuzz_reader_mutated_parquet_reads_or_fails_in_one_line(tmp_path_factory, tok, edits):
    folder = tmp_path_factory.mktemp("pq")
    clean = write_verl_parquet(folder / "clean.parquet", n=4)
    path = folder / "m.parquet"
    with open(clean, "rb") as f:
        path.write_bytes(_mutate(f.read(), edits))
    try:
        source = PromptSource(DataConfig(source=str(path)), tok)
    except DataError as e:
        assert "\n" not in str(e)
        return
    assert next(source).prompt_ids


# ---- end to end: two steps of the tiny preset ----------------------------------------------------


def _train_two_steps(tmp_path, name, *data_flags):
    from test_e2e import _env, _rows
    from test_launch import TORCHRUN, _kill_group

    tag = uuid.uuid4().hex
    cmd = [
        *TORCHRUN,
        "-m",
        "staleflow",
        "train",
        "--preset",
        "tiny",
        "--steps",
        "2",
        "--log.run-dir",
        str(tmp_path),
        "--log.name",
        name,
        "--reward.fn",
        "e2e_rewards:text_length",
        "--staleness.batch-size",
        "2",
        "--staleness.group-size",
        "2",
        "--rollout.max-new-tokens",
        "8",
        "--checkpoint.every",
        "0",
        "--checkpoint.no-export-hf",
        "--log.no-tensorboard",
        "--log.no-plot",
        "--log.no-progress",
        *data_flags,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(tag), start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, out[-3000:]
    run = os.path.join(tmp_path, name)
    steps = [r for r in _rows(os.path.join(run, "metrics.jsonl")) if "trained_trajectories" in r]
    trained = _rows(os.path.join(run, "trained.jsonl"))
    assert len(steps) == 2 and trained
    return run, trained


@pytest.mark.slow
def test_verl_format_parquet_trains_two_steps_of_the_tiny_preset(tmp_path):
    path = write_verl_parquet(tmp_path / "train.parquet", n=16)
    run, trained = _train_two_steps(tmp_path, "verl", "--data.source", path)
    answers = {str(2 * i) for i in range(16)}
    assert {r["answer"] for r in trained} <= answers and all("+" in r["prompt"] for r in trained)
    # the run's written config repeats the run: parsed back, it is the same resolved config
    from staleflow.config import RunConfig, config_from_dict, resolve
    from staleflow.config.parse import parse
    from staleflow.presets import PRESETS

    with open(os.path.join(run, "config.json")) as f:
        written = config_from_dict(RunConfig, json.load(f))
    again = resolve(parse(RunConfig, ["--config", os.path.join(run, "config.yaml")], PRESETS, "smollm2-cpu", "t"))
    assert again == written and again.data.source == path


@pytest.mark.slow
def test_datasets_save_to_disk_folder_trains_two_steps_of_the_tiny_preset(tmp_path):
    folder = write_disk(tmp_path / "ds", n=16)
    _, trained = _train_two_steps(tmp_path, "disk", "--data.source", folder, "--data.prompt-field", "question")
    assert {r["answer"] for r in trained} <= {str(3 * i) for i in range(16)}


def test_data_mix_held_out_evaluation_is_reported_per_source(tmp_path, tok):
    """Each source's held-out accuracy lands in the evaluation row (eval_accuracy@SOURCE)."""
    from test_eval import RingRecords

    from staleflow.runtime.evaluation import HeldOutEval

    a = write_verl_parquet(tmp_path / "a.parquet", n=20, source="a")
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": i}) + "\n" for i in range(20)))
    source = PromptSource(DataConfig(mix=f"{a}:0.5,{b}:0.5"), tok)
    held = source.hold_out(8)
    ev = HeldOutEval(held, "arithmetic", tok, 8)
    ev.start(0, [1], lambda rank, msg: None)
    row, records = None, RingRecords()
    for i, p in enumerate(held):  # every a-prompt answered right, every b-prompt wrong
        right = p.meta["mix_source"] == a
        text = f"\\boxed{{{p.answer if right else 'x'}}}"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        row = ev.on_answer(records.answer(0, i, ids, 0, 0), records) or row
    records.close()
    assert row[f"eval_accuracy@{a}"] == 1.0 and row[f"eval_accuracy@{b}"] == 0.0
    assert row[f"eval_n@{a}"] == row[f"eval_n@{b}"] == 4 and row["eval_accuracy"] == 0.5


def test_datasets_meta_of_any_column_type_is_json(tmp_path, tok):
    """A parquet's timestamp / binary / decimal columns reach meta as text: a checkpoint keeps the
    in-flight prompts as JSON."""
    import datetime
    import decimal

    rows = [
        {"prompt": "Say 1.", "answer": "1", "when": datetime.datetime(2026, 1, 2), "raw": b"\x00\x01",
         "price": decimal.Decimal("1.50"), "nested": {"t": datetime.date(2026, 1, 3)}}
    ] * 3  # fmt: skip
    path = tmp_path / "typed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    p = next(PromptSource(DataConfig(source=str(path)), tok))
    json.dumps(p.meta)
    assert p.meta["when"].startswith("2026-01-02") and p.meta["nested"]["t"] == "2026-01-03"


def test_data_mix_trained_groups_follow_the_weights_through_the_controller_loop(tmp_path, tok):
    """The mix as the run sees it: the controller loop (scripted ranks, every trajectory finished at
    once, rewards that always differ within a group) trains groups whose sources follow 0.7 / 0.3.
    Deterministic (seeded draws, scripted events), with a 6-sigma binomial bound."""
    from controller_fakes import ScriptedBackend
    from test_controller import COST

    from staleflow.config import CoordinatorConfig, RunConfig, StalenessConfig
    from staleflow.controller import Finished, Published, PullDone, Rewarded, TrainDone
    from staleflow.controller.build import build_loop
    from staleflow.coordinator import Pull
    from staleflow.runtime.backend import RuntimeWorkload
    from staleflow.trajectory import Route

    a = write_verl_parquet(tmp_path / "a.parquet", n=30, source="a")
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"prompt": f"B question {i}?", "answer": i}) + "\n" for i in range(30)))
    cfg = RunConfig(data=DataConfig(mix=f"{a}:0.7,{b}:0.3", seed=1))
    source = PromptSource(cfg.data, tok)
    steps = 60
    stale = StalenessConfig(eta=1, batch_size=4, group_size=2)
    ccfg = CoordinatorConfig(routing="least-loaded", mlq=False, migration=False)
    be = ScriptedBackend()
    loop = build_loop("staleflow", stale, ccfg, COST, range(2), be, RuntimeWorkload(cfg, source), steps)
    finished = set()
    for _ in range(20 * steps):
        if loop.version >= steps:
            break
        loop.refill()
        loop.tick(be.now() + 0.01)
        for cmd in [c for c in be.sent if isinstance(c, Route) and c.traj_id not in finished]:
            finished.add(cmd.traj_id)
            be.events.append(Finished(cmd.traj_id, cmd.instance, f"rec-{cmd.traj_id}", 4))
        for ev in be.poll(be.t):
            loop.handle(ev)
        for tid in be.scored:
            loop.handle(Rewarded(tid, float(tid % 2)))  # group members have consecutive ids: never all equal
        be.scored.clear()
        loop.maybe_train()
        if be.trained:
            version, _ = be.trained.pop()
            loop.handle(TrainDone(version + 1))
            loop.handle(Published(version + 1))
        for cmd in [c for c in be.sent if isinstance(c, Pull)]:
            be.sent.remove(cmd)
            loop.handle(PullDone(cmd.instance, cmd.version))
    assert loop.version == steps and loop.audit.violations == []
    sources = [p.meta["mix_source"] for rec in loop.steps for p in rec.prompts.values()]
    assert len(sources) == steps * 4
    k = sources.count(a)
    assert abs(k - 0.7 * len(sources)) <= 6 * math.sqrt(len(sources) * 0.21), k
