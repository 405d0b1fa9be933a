"""Bounded readers where outside input enters (issue 50, the medium and low items): each crafted input
ends in ONE line and a non-zero exit (or a bad-row report) within bounded time and under 1 GB, never a
hang, a traceback or a file opened outside its folder. The subprocess cases run ``staleflow check`` as a
user would, under tests/bounded_run.py (killed at the time limit: a hang fails the test; peak memory
read from the process itself); the reader cases call the reader the run uses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bounded_run import GB, run_bounded, staleflow

from staleflow.config import ConfigError, DataConfig
from staleflow.config.file import parse_text
from staleflow.data import DataError
from staleflow.data.files import read_rows
from staleflow.model.hf import ModelLoadError, safetensors_files
from staleflow.runfolder.lock import check_unlocked, lock_run_dir

ROOT = Path(__file__).resolve().parents[1]
TINY = Path.home() / ".cache" / "staleflow" / "tiny-llama"


def _one_line(out, *needles: str) -> str:
    assert out.code not in (0, None), (out.code, out.stderr[-2000:])  # None: killed at the time limit (a hang)
    assert len(out.lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    for n in needles:
        assert n in out.lines[0], out.lines[0]
    assert out.peak_bytes < GB, out.peak_bytes
    return out.lines[0]


# ---- config files -----------------------------------------------------------------------------------


def _alias_bomb(levels: int = 26) -> str:
    lines = ["a0: &a0 [x]"] + [f"a{i}: &a{i} {{p: *a{i - 1}, q: *a{i - 1}}}" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_bounded_reader_yaml_alias_bomb_is_refused_before_expansion(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    assert bomb.stat().st_size < 1024  # 26 levels: 2**26 leaves once expanded
    _one_line(staleflow("check", "--preset", "tiny", "--config", str(bomb)), "expands to more than", "aliases")
    with pytest.raises(ConfigError, match="refers to itself"):
        parse_text("a: &a [1, *a]\n", "self.yaml")
    with pytest.raises(ConfigError, match="more than"):
        parse_text("x: " + "[" * 40 + "]" * 40 + "\n", "deep.yaml")
    fine = parse_text("base: &b {lr: 1.0e-6}\ntrain: *b\n", "ok.yaml")  # an ordinary alias still works
    assert fine["train"] == {"lr": 1e-6}


def test_bounded_reader_config_file_that_is_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "flags.yaml")
    _one_line(staleflow("check", "--preset", "tiny", "--config", str(tmp_path / "flags.yaml")), "FIFO")


# ---- chat templates ---------------------------------------------------------------------------------


def _model_with_template(tmp_path: Path, template: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for f in TINY.iterdir():
        if f.name != "chat_template.jinja" and not f.name.startswith("."):
            shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(template)
    return folder


LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
OUTPUT = "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'xxxxxxxx' }}{% endfor %}{% endfor %}"
RECURSIVE = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"


@pytest.mark.parametrize("template", [LOOPS, OUTPUT, RECURSIVE], ids=["nested-loops", "output", "recursive-macro"])
def test_bounded_reader_runaway_chat_template_is_one_line(tmp_path, template):
    model = _model_with_template(tmp_path, template)
    _one_line(staleflow("check", "--preset", "tiny", "--model.path", str(model)), "the chat template", "chat_template")


def test_bounded_reader_recursive_template_in_eval_is_one_line(tmp_path):
    model = _model_with_template(tmp_path, RECURSIVE)
    out = staleflow("eval", "--model.path", str(model), "--data.source", "arithmetic-easy", "--n", "2")
    _one_line(out, "recursed too deeply")


# ---- data sources -----------------------------------------------------------------------------------

WRITE_BOMB = """
import sys, pyarrow as pa, pyarrow.parquet as pq
rows = int(sys.argv[2])
prompts = ["x" * (256 << 20)] + [f"What is {i} + {i}?" for i in range(rows)]
pq.write_table(pa.table({"prompt": prompts, "answer": [str(2 * i) for i in range(rows + 1)]}), sys.argv[1],
               compression="zstd", row_group_size=int(sys.argv[3]))
"""


def _parquet_bomb(path: Path, rows: int = 0, group: int = 1) -> Path:
    subprocess.run([sys.executable, "-c", WRITE_BOMB, str(path), str(rows), str(group)], check=True, timeout=300)
    return path


def test_bounded_reader_parquet_zstd_bomb_row_is_refused(tmp_path):
    bomb = _parquet_bomb(tmp_path / "bomb.parquet")
    assert bomb.stat().st_size < 64 << 10  # ~9 KB on disk, 256 MB as a prompt
    cache = tmp_path / "hf"
    out = run_bounded(
        [sys.executable, "-m", "staleflow", "check", "--preset", "tiny", "--data.source", str(bomb)],
        env={**os.environ, "HF_DATASETS_CACHE": str(cache)},
    )
    _one_line(out, "none of its 1 rows is usable", "too_large")
    assert not cache.exists() or sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) < 1 << 20


def test_bounded_reader_parquet_big_row_among_good_ones_is_a_bad_row(tmp_path):
    """One 256 MB row in a row group with 40 good ones: that row is a bad row, the others load."""
    bomb = _parquet_bomb(tmp_path / "mixed.parquet", rows=40, group=64)
    rows, bad, _ = read_rows(str(bomb), DataConfig())
    assert len(rows) == 40 and [(b.location.rsplit(":", 1)[1], b.kind) for b in bad] == [("1", "too_large")]


def test_bounded_reader_dataset_features_are_never_decoded(tmp_path):
    """A parquet whose huggingface metadata declares a column as Image with a path to a FIFO: the path is
    data (meta), never opened (before: PIL opened it, and a FIFO hung the check)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.mkfifo(tmp_path / "fifo")
    img = pa.array(
        [{"bytes": None, "path": str(tmp_path / "fifo")}] * 3,
        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    table = pa.table({"prompt": ["What is 1 + 1?"] * 3, "answer": ["2"] * 3, "img": img})
    features = {"info": {"features": {"prompt": {"dtype": "string", "_type": "Value"},
                                      "answer": {"dtype": "string", "_type": "Value"}, "img": {"_type": "Image"}}}}  # fmt: skip
    pq.write_table(
        table.replace_schema_metadata({b"huggingface": json.dumps(features).encode()}), tmp_path / "i.parquet"
    )
    out = staleflow("check", "--preset", "tiny", "--data.source", str(tmp_path / "i.parquet"), limit_s=90)
    assert out.code == 0 and "3 usable" in out.stderr, out.stderr[-2000:]
    rows, bad, _ = read_rows(str(tmp_path / "i.parquet"), DataConfig())
    assert len(rows) == 3 and rows[0].meta["img"]["path"] == str(tmp_path / "fifo") and not bad


def _disk(tmp_path: Path, name: str, edit) -> Path:
    import datasets

    folder = tmp_path / name
    datasets.Dataset.from_dict({"prompt": ["What is 1 + 1?"] * 4, "answer": ["2"] * 4}).save_to_disk(str(folder))
    state = json.loads((folder / "state.json").read_text())
    edit(folder, state)
    (folder / "state.json").write_text(json.dumps(state))
    return folder


def _outside(folder: Path, state: dict) -> None:
    secret = folder.parent / "secret"
    secret.mkdir(exist_ok=True)
    shutil.copy(folder / state["_data_files"][0]["filename"], secret / "x.arrow")
    state["_data_files"] = [{"filename": "../secret/x.arrow"}]


def _absolute(folder: Path, state: dict) -> None:
    _outside(folder, state)
    state["_data_files"] = [{"filename": str(folder.parent / "secret" / "x.arrow")}]


def _fifo(folder: Path, state: dict) -> None:
    os.mkfifo(folder / "fifo.arrow")
    state["_data_files"] = [{"filename": "fifo.arrow"}]


@pytest.mark.parametrize(
    "edit,needle",
    [
        (_outside, "not a file name inside the folder"),
        (_absolute, "not a file name inside the folder"),
        (_fifo, "FIFO"),
        (lambda f, s: s.update(_data_files="x.arrow"), "no list of _data_files"),
        (lambda f, s: s.update(_data_files=[{"filename": 7}]), "not a file name"),
    ],
    ids=["dotdot", "absolute", "fifo", "not-a-list", "not-a-string"],
)
def test_bounded_reader_save_to_disk_names_stay_in_their_folder(tmp_path, edit, needle):
    folder = _disk(tmp_path, "ds", edit)
    with pytest.raises(DataError, match=needle) as e:
        read_rows(str(folder), DataConfig())
    assert "\n" not in str(e.value)


def test_bounded_reader_save_to_disk_escape_refused_by_check(tmp_path):
    folder = _disk(tmp_path, "ds", _outside)
    _one_line(staleflow("check", "--preset", "tiny", "--data.source", str(folder)), "../secret/x.arrow")
    (tmp_path / "deep").mkdir()
    shutil.copytree(folder, tmp_path / "deep" / "ds")
    (tmp_path / "deep" / "ds" / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="nested too deeply"):
        read_rows(str(tmp_path / "deep" / "ds"), DataConfig())


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".json"])
def test_bounded_reader_data_file_that_is_a_fifo(tmp_path, suffix):
    os.mkfifo(tmp_path / f"d{suffix}")
    with pytest.raises(DataError, match="FIFO"):
        read_rows(str(tmp_path / f"d{suffix}"), DataConfig())


def test_bounded_reader_json_array_rows_are_sized_one_by_one(tmp_path):
    big = "x" * ((16 << 20) + 10)
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": big, "answer": "1"}, 3]))
    rows, bad, _ = read_rows(str(path), DataConfig())
    assert len(rows) == 1 and [(b.location[-1], b.kind) for b in bad] == [("2", "too_large"), ("3", "not_object")]


# ---- model folders ----------------------------------------------------------------------------------


def _indexed(tmp_path: Path, weight_map) -> Path:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors.index.json").write_text(
        weight_map if isinstance(weight_map, str) else json.dumps({"weight_map": weight_map})
    )
    return folder


@pytest.mark.parametrize(
    "weight_map,needle",
    [
        ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        (["model.safetensors"], "weight_map must be an object"),
        ({"a.weight": 7}, "weight_map must be an object"),
        ({"a.weight": "../outside.safetensors"}, "not a file name inside the model folder"),
        ({"a.weight": "/etc/passwd"}, "not a file name inside the model folder"),
        ({"a.weight": "fifo.safetensors"}, "FIFO"),
    ],
    ids=["deep", "list", "not-a-string", "dotdot", "absolute", "fifo"],
)
def test_bounded_reader_safetensors_index(tmp_path, weight_map, needle):
    folder = _indexed(tmp_path, weight_map)
    os.mkfifo(folder / "fifo.safetensors")
    (tmp_path / "outside.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ModelLoadError, match=needle) as e:
        safetensors_files(folder)
    assert "\n" not in str(e.value)


def test_bounded_reader_safetensors_index_refused_by_check(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/hostname"}}))
    _one_line(staleflow("check", "--preset", "tiny", "--model.path", str(folder)), "not a file name inside")


def test_bounded_reader_model_folder_file_that_is_a_fifo(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")  # opened by the tokenizers library: it would block for ever
    _one_line(staleflow("check", "--preset", "tiny", "--model.path", str(folder)), "tokenizer.json", "FIFO")


# ---- run folders ------------------------------------------------------------------------------------


def test_bounded_reader_run_lock_that_is_a_fifo(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_checkpoint_readers import make_checkpoint

    run = tmp_path / "run"
    make_checkpoint(run / "checkpoints", 2)
    os.mkfifo(run / "run.lock")
    _one_line(staleflow("check", "--preset", "tiny", "--resume", str(run)), "run.lock", "FIFO", "rm ")
    with pytest.raises(ConfigError, match="FIFO"):
        lock_run_dir(str(run))
    with pytest.raises(ConfigError, match="FIFO"):
        check_unlocked(str(run))


# ---- the scripts' records ---------------------------------------------------------------------------


def _run_folder(tmp_path: Path, trained: list, metrics: list) -> Path:
    run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    run.mkdir()
    (run / "trained.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in trained))
    (run / "metrics.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in metrics))
    return run


GOOD_GROUP = {"buffer": 1, "group_id": 0, "traj_version": 0, "rewards": [1.0, 0.0], "n_tokens": [4, 5]}
GOOD_STEP = {"step": 1, "time": 2.0, "reward_mean": 0.5}


@pytest.mark.parametrize(
    "trained,metrics,needle",
    [
        ([{**GOOD_GROUP, "rewards": []}], [GOOD_STEP], "'rewards'"),
        ([{**GOOD_GROUP, "buffer": "1"}], [GOOD_STEP], "'buffer'"),
        ([{**GOOD_GROUP, "n_tokens": [1e30]}], [GOOD_STEP], "'n_tokens'"),
        ([GOOD_GROUP], ['{"step": 1, "time": NaN}'], "'time'"),
        ([GOOD_GROUP], [{**GOOD_STEP, "interrupts": 1e30}], "'interrupts'"),
        (["[" * 100_000 + "]" * 100_000], [GOOD_STEP], "no trained groups"),
    ],
    ids=["empty-rewards", "wrong-type", "1e30-tokens", "nan-time", "1e30-count", "deep-line"],
)
def test_bounded_reader_compare_runs_records(tmp_path, trained, metrics, needle):
    good = _run_folder(tmp_path, [GOOD_GROUP], [GOOD_STEP])
    bad = _run_folder(tmp_path, trained, metrics)
    out = run_bounded([sys.executable, "scripts/compare_runs.py", str(good), str(bad)], limit_s=90)
    line = _one_line(out, "compare_runs:", needle)
    assert out.code == 2, line


def test_bounded_reader_bench_convergence_no_run_records(tmp_path):
    out_dir = tmp_path / "out"
    run = out_dir / "verl-sync-eta0-seed0"
    run.mkdir(parents=True)
    (run / "bench.json").write_text(
        json.dumps({"wall_s": float("nan"), "load_start": 1, "load_end": 1}).replace("NaN", "1e400")
    )
    (run / "metrics.jsonl").write_text(json.dumps(GOOD_STEP) + "\n")
    argv = [sys.executable, "scripts/bench_convergence.py", "--no-run", "--out", str(out_dir), "--modes", "verl-sync",
            "--seeds", "0"]  # fmt: skip
    _one_line(run_bounded(argv, limit_s=90), "bench.json", "'wall_s'")
    (run / "bench.json").write_text(json.dumps({"wall_s": 5.0, "load_start": 1, "load_end": 1}))
    (run / "metrics.jsonl").write_text(json.dumps({**GOOD_STEP, "staleness_hist": {"0": "many"}}) + "\n")
    _one_line(run_bounded(argv, limit_s=90), "metrics.jsonl:1", "'staleness_hist'")


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000, None], ids=["deep-line", "fifo"])
def test_bounded_reader_fit_cost_model_samples(tmp_path, body):
    path = tmp_path / "samples.jsonl"
    if body is None:
        os.mkfifo(path)
    else:
        path.write_text(body + "\n")
    out = run_bounded(
        [sys.executable, "scripts/fit_cost_model.py", "--samples", str(path), "--out", str(tmp_path / "f.json")]
    )
    _one_line(out, "fit_cost_model:")


# ---- numeric flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--train.entropy-coef", "-1e30"),
        ("--coordinator.migration-cooldown-s", "-1e30"),
        ("--coordinator.migration-cooldown-s", "1e30"),
        ("--train.kl-coef", "1e30"),
        ("--rollout.temperature", "1e30"),
        ("--rollout.max-running", str(10**20)),
        ("--train.lr", "nan"),
    ],
)
def test_bounded_reader_numeric_flags_are_finite_and_ranged(tmp_path, flag, value):
    """In a --config file (and so in a resumed run's config.json, decoded the same way): one line."""
    from staleflow.config import RunConfig, resolve
    from staleflow.config.parse import parse
    from staleflow.presets import PRESETS

    section, key = flag.removeprefix("--").split(".")
    path = tmp_path / "flags.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError) as e:
        resolve(parse(RunConfig, ["--preset", "tiny", "--config", str(path)], PRESETS, default="tiny", prog="t"))
    assert flag.removeprefix("--") in str(e.value) and "\n" not in str(e.value)


def test_bounded_reader_numeric_flag_refused_by_check(tmp_path):
    (tmp_path / "flags.yaml").write_text("train:\n  entropy_coef: -1.0e30\ncoordinator:\n  migration_cooldown_s: 5\n")
    out = staleflow("check", "--preset", "tiny", "--config", str(tmp_path / "flags.yaml"))
    _one_line(out, "--train.entropy-coef", "[-10, 10]")
    out = staleflow("check", "--preset", "tiny", "--coordinator.migration-cooldown-s=-1e30")  # tyro's own box
    assert out.code == 2 and "--coordinator.migration-cooldown-s=-1e+30 is invalid: must be in [0," in " ".join(
        x.strip("│ ") for x in out.lines
    )
