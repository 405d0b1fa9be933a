"""Run-folder files read back by --resume (metrics.jsonl, trained.jsonl, ids.json): any content gives
rows (a line that is not a JSON object is counted as unreadable), never an exception or a hang."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.durable import read_jsonl
from staleflow.runfolder.run_dir import read_ids, supersede_after

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["step", "buffer", "x"]), inner),
    max_leaves=8,
)
_LINE = st.one_of(
    _JSON.map(json.dumps),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
    st.integers(1, 100_000).map(lambda n: "[" * n),  # a row of nested brackets: RecursionError in json
    st.just('{"step": 3, "reward_mean": 0.2'),  # torn by a crash
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_LINE, max_size=6), version=st.integers(0, 5))
def test_fuzz_reader_run_jsonl(tmp_path_factory, lines, version):
    run = tmp_path_factory.mktemp("run")
    for name in ("metrics.jsonl", "trained.jsonl"):
        (run / name).write_text("".join(line.replace("\n", " ") + "\n" for line in lines), errors="surrogatepass")
    rows, bad = read_jsonl(run / "metrics.jsonl")
    assert all(isinstance(r, dict) for r in rows) and len(rows) + bad <= len(lines)
    supersede_after(str(run), version, [])
    again, bad_again = read_jsonl(run / "metrics.jsonl")
    assert bad_again == 0 and len(again) == len(rows)  # unreadable lines dropped, every row kept


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_JSON | st.dictionaries(st.sampled_from(["next_traj", "next_group"]), _JSON))
def test_fuzz_reader_ids(tmp_path_factory, value):
    run = tmp_path_factory.mktemp("run")
    (run / "ids.json").write_text(json.dumps(value))
    ids = read_ids(str(run))
    assert all(k in ("next_traj", "next_group") and type(v) is int and v >= 0 for k, v in ids.items())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=_LINE)
def test_fuzz_reader_elastic_pointer(monkeypatch, tmp_path_factory, content):
    """The elastic pointer file (/tmp/staleflow-elastic-<id>.json) read with any content: no exception."""
    from staleflow.runfolder import elastic as resume

    folder = tmp_path_factory.mktemp("ptr")
    monkeypatch.setattr(resume.tempfile, "gettempdir", lambda: str(folder))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "fuzzptr")
    pointer = resume.elastic_pointer()
    pointer.write_text(content.replace("\n", " "), errors="surrogatepass")
    resume.is_fatal()
    resume.mark_fatal("bad input")
    assert resume.is_fatal()
