"""`staleflow check` reads the WHOLE dataset as the run will and says what it found (issue 50): rows, bad
rows by reason with the first row number of each, the field used as the answer; --data.bad-rows error
refuses the first bad row in one line. Before, it read the first 8 rows and exited 0 silently on a
file where 5 of 6 rows were bad, even with --data.bad-rows error (eval refused it at row 2)."""

from __future__ import annotations

import json

from bounded_run import GB, staleflow

SIX = [
    {"prompt": "What is 1 + 1?", "answer": "2"},
    {"question": "What is 2 + 2?", "answer": "4"},  # wrong key
    '{"prompt": "What is 3 + 3?", "answer": "6"',  # broken JSON
    {"answer": "8"},  # no prompt
    {"prompt": "What is 5 + 5?", "answer": None},  # null answer
    {"prompt": "What is 6 + 6?", "answer": [12]},  # list answer
]


def _jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_check_rows_summary_of_the_issues_file(tmp_path):
    data = _jsonl(tmp_path / "six.jsonl", SIX)
    out = staleflow("check", "--preset", "tiny", "--data.source", data, "--data.bad-rows", "skip")
    assert out.code == 0 and out.peak_bytes < GB, out.stderr[-2000:]
    (line,) = [x for x in out.lines if x.startswith("staleflow: data ")]
    assert "6 rows read, 1 usable, 5 bad" in line
    assert "invalid_json 1 (first row 3)" in line and "missing_field 2 (first row 2)" in line
    assert "not_string 2 (first row 5)" in line and "answer field: answer (1 row)" in line
    out = staleflow("check", "--preset", "tiny", "--data.source", data, "--data.bad-rows", "error")
    assert out.code == 2 and len(out.lines) == 1, out.stderr[-2000:]
    assert out.lines[0].startswith(f"staleflow: config error: bad data row {data}:2: missing field 'prompt'")
    assert "--data.bad-rows skip" in out.lines[0]


def test_check_rows_reads_past_the_first_rows(tmp_path):
    """A bad row at row 40, an unscorable answer at row 30 and a prompt over the token limit at row 20
    are found: the whole file is read, and judged as the run judges it."""
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(45)]
    rows[19] = {"prompt": "word " * 400, "answer": "1"}
    rows[29] = {"prompt": "What is half of 5?", "answer": "\\frac{5}{2}"}
    rows[39] = {"prompt": "", "answer": "3"}
    rows[40] = {"problem": "x", "solution": "4"}
    data = _jsonl(tmp_path / "long.jsonl", rows)
    out = staleflow("check", "--preset", "tiny", "--data.source", data, "--data.max-prompt-tokens", "256")
    assert out.code == 0, out.stderr[-2000:]
    (line,) = [x for x in out.lines if x.startswith("staleflow: data ")]
    assert "45 rows read, 41 usable, 4 bad" in line, line
    for kind, row in (("too_long", 20), ("unscorable", 30), ("empty", 40), ("missing_field", 41)):
        assert f"{kind} 1 (first row {row})" in line, line
    out = staleflow(
        "check",
        "--preset",
        "tiny",
        "--data.source",
        data,
        "--data.bad-rows",
        "error",
        "--data.max-prompt-tokens",
        "256",
    )
    assert out.code == 2 and f"bad data row {data}:20:" in out.lines[0], out.stderr[-2000:]


def test_check_rows_answer_fields_are_named(tmp_path):
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}] * 3 + [{"prompt": "What is 2 + 2?", "solution": "4"}] * 2
    out = staleflow("check", "--preset", "tiny", "--data.source", _jsonl(tmp_path / "mixed.jsonl", rows))
    assert out.code == 0 and "answer field: answer (3 rows), solution (2 rows)" in out.stderr, out.stderr[-2000:]


def test_check_rows_no_usable_row_is_one_line(tmp_path):
    data = _jsonl(tmp_path / "none.jsonl", SIX[1:])
    out = staleflow("check", "--preset", "tiny", "--data.source", data)
    assert out.code == 2 and len(out.lines) == 1 and "none of its 5 rows is usable" in out.lines[0], out.stderr
