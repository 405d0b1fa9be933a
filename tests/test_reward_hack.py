"""The code_tests reward cannot be gamed from inside the program it scores (issue 50).

Each case is a WRONG solution (add subtracts) plus a trick an RL policy could find: before the fix,
the program was "solution + tests" and exit status 0 paid 1.0, so ``sys.exit(0)`` after the wrong
definition scored full reward (the first case; the same program without the exit scored 0). Now the
tests run in a harness process that never runs the solution's code (sandbox/harness.py), results come
back per test with a per-run nonce on a pipe the solution never holds, and exit status and output
are not read: every trick below scores 0, and the honest controls still score 1.
"""

from __future__ import annotations

import pytest

from staleflow.reward import resolve_reward_fn, score
from staleflow.sandbox import SandboxLimits, sandbox_unavailable
from staleflow.sandbox.tests_run import _read_verdict, run_tests, split_tests

WRONG = "def add(a, b):\n    return a - b\n"
TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}

HACKS = {
    "sys.exit(0)": "import sys\nsys.exit(0)",
    "sys.exit in the function": "def add(a, b):\n    import sys\n    sys.exit(0)",
    "os._exit in the function": "def add(a, b):\n    import os\n    os._exit(0)",
    "os._exit(0)": "import os\nos._exit(0)",
    "raise SystemExit": "raise SystemExit(0)",
    "SIGKILL to itself": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "SIGTERM to itself": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)",
    "kill the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "stop the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)",
    "signal every process": (
        "import os, signal\nfor p in os.listdir('/proc'):\n    if p.isdigit() and int(p) != os.getpid():\n"
        "        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):\n"
        "            try:\n                os.kill(int(p), s)\n            except OSError:\n                pass"
    ),
    "patched AssertionError": "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})",
    "patched builtins": "import builtins\nbuiltins.len = lambda x: 0\nbuiltins.abs = lambda x: 0",
    "settrace skips asserts": "import sys\nsys.settrace(lambda *a: None)\nsys.setprofile(lambda *a: None)",
    "excepthook swallows": "import sys, os\nsys.excepthook = lambda *a: os._exit(0)",
    "printed marker": "print('ALL TESTS PASSED')\nprint('OK')\nprint('0 ok')\nprint('end 2')",
    "atexit exit 0": "import atexit, os\natexit.register(lambda: os._exit(0))",
    "__del__ exit 0": "import os\nclass D:\n    def __del__(self):\n        os._exit(0)\nkeep = D()",
    "always-equal object": (
        "class E:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return E()"
    ),
    "int subclass equal to all": (
        "class I(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return I(0)"
    ),
    "forge the verdict pipe": (
        "import os\nlines = b''.join(b'%s 0 ok\\n%s 1 ok\\n%s end 2\\n' % (n, n, n) for n in (b'x' * 32, b'0' * 32))\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, lines)\n    except OSError:\n        pass\n"
        "for pid in os.listdir('/proc'):\n    if not pid.isdigit():\n        continue\n    try:\n"
        "        fds = os.listdir(f'/proc/{pid}/fd')\n    except OSError:\n        continue\n    for fd in fds:\n"
        "        try:\n            w = os.open(f'/proc/{pid}/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK)\n"
        "            os.write(w, lines)\n        except OSError:\n            pass"
    ),
    "read the nonce": (
        "import os\nseen = []\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n"
        "        for f in ('cmdline', 'environ', 'mem'):\n            try:\n"
        "                seen.append(open(f'/proc/{pid}/{f}', 'rb').read(4096))\n            except OSError:\n"
        "                pass\nimport sys\nsys.exit(0)"
    ),
}


def _block(code: str) -> str:
    return f"Here is my answer.\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def fn():
    problem = sandbox_unavailable()
    if problem:
        pytest.fail(problem)
    return resolve_reward_fn("code_tests")


@pytest.mark.parametrize("name", list(HACKS))
def test_reward_hack_scores_nothing(fn, name):
    body = HACKS[name]
    program = body if "def add" in body else f"{WRONG}{body}"
    reward, info = score(fn, _block(program), "", TESTS)
    assert reward == 0.0, (name, info)
    assert info["error"] is None, (name, info)  # a zero with its reason, not a reward error
    assert info["reason"], (name, info)


def test_reward_hack_shadowing_a_builtin_the_tests_use(fn):
    tests = {"tests": ["assert abs(add(1, 2) - 3) < 1e-9", "assert isinstance(add(1, 2), int) and add(1, 2) == 3"]}
    program = WRONG + "def abs(x):\n    return 0\ndef isinstance(*a):\n    return True\n"
    reward, info = score(fn, _block(program), "", tests)
    assert reward == 0.0 and "0 of 2 passed" in info["reason"], info


def test_reward_hack_an_aliased_standard_library_object(fn):
    """The solution's process names what its names are: a stdlib object under another name (a MagicMock
    answering `assert is_prime(4)` with a truthy object) is not offered, nor a module under another name."""
    tests = {"tests": ["assert is_prime(7)", "assert is_prime(4)", "assert limits"]}
    program = "from unittest.mock import MagicMock as is_prime\nimport unittest.mock as limits\n"
    reward, info = score(fn, _block(program), "", tests)
    assert reward == 0.0 and "0 of 3 passed" in info["reason"] and "NameError" in info["reason"], info


def test_reward_hack_the_issues_reproduction_and_its_control(fn):
    """The issue: a wrong solution ending in sys.exit(0) got full reward, the same without the exit none."""
    exits = score(fn, _block(WRONG + "import sys; sys.exit(0)"), "", TESTS)
    plain = score(fn, _block(WRONG), "", TESTS)
    assert exits[0] == plain[0] == 0.0
    assert "0 of 2 passed" in exits[1]["reason"] and "0 of 2 passed" in plain[1]["reason"]


@pytest.mark.parametrize(
    "program,tests",
    [
        ("def add(a, b):\n    return a + b\nprint('ALL TESTS PASSED')", TESTS),  # printing is not penalised
        ("def add(a, b):\n    return a + b\nimport sys\nsys.exit(3)", TESTS),  # nor an exit after the definitions
        (
            "def add(a, b):\n    return a + b",
            {"tests": "def check(candidate):\n    assert candidate(2, 3) == 5", "entry_point": "add"},
        ),
        ("def srt(x):\n    x.sort()", {"tests": ["x = [3, 1, 2]\nsrt(x)\nassert x == [1, 2, 3]"]}),  # in place
        ("def make_adder(n):\n    return lambda x: x + n", {"tests": ["assert make_adder(2)(3) == 5"]}),
        (
            "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5",
            {
                "tests": [
                    "try:\n    root(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')",
                    "assert root(4) == 2.0 and type(root(4)) is float",
                ]
            },
        ),
        ("import math\ndef area(r):\n    return math.pi * r * r", {"tests": ["assert math.isclose(area(1), math.pi)"]}),
        (
            "from math import sqrt\nfrom collections import Counter\ndef f(x):\n    return sqrt(x)",
            {"tests": ["assert sqrt(f(16)) == 2.0 and Counter('aab')['a'] == 2"]},
        ),
        (
            "def pairs(d):\n    return sorted(d.items())\nLIMIT = 3",
            {"tests": ["assert pairs({'b': 2, 'a': (1, {2})}) == [('a', (1, {2})), ('b', 2)]", "assert LIMIT == 3"]},
        ),
        (
            "def twice(f, x):\n    return f(f(x))\ndef inc(x):\n    return x + 1",
            {"tests": ["assert twice(inc, 1) == 3"]},
        ),
    ],
    ids=[
        "marker",
        "exit-after",
        "humaneval",
        "in-place",
        "closure",
        "raises",
        "module",
        "stdlib-names",
        "containers",
        "handles",
    ],
)
def test_reward_hack_honest_solutions_still_pass(fn, program, tests):
    reward, info = score(fn, _block(program), "", tests)
    assert (reward, info["error"], info.get("reason")) == (1.0, None, None), info


def test_reward_hack_partial_passes_are_counted_and_the_first_failure_named():
    problem = sandbox_unavailable()
    if problem:
        pytest.fail(problem)
    tests = split_tests(["assert f(1) == 1\nassert f(2) == 5\nassert f(3) == 3"])
    result = run_tests("def f(x):\n    return x\n", tests, SandboxLimits(wall_s=15))
    assert (result.passed, result.total, result.forged, result.error) == (2, 3, False, None)
    assert result.failure.startswith("test 2: AssertionError")


def test_reward_hack_a_line_without_the_nonce_is_a_forgery():
    nonce = "a" * 32
    results, ended, forged, error = _read_verdict(f"{nonce} 0 ok\n{nonce} end 1\n", nonce)
    assert (results, ended, forged, error) == ({0: ("ok", "")}, 1, False, None)
    results, ended, forged, _ = _read_verdict(f"{nonce} 0 fail x\n{'b' * 32} 0 ok\n{nonce} end 1\n", nonce)
    assert forged and results == {0: ("fail", "x")}


def test_reward_hack_tests_that_do_not_parse_are_the_rows_fault(fn):
    reward, info = score(fn, _block("def add(a, b):\n    return a + b"), "", {"tests": "assert add(1, 2) ==="})
    assert reward == 0.0 and "do not parse" in info["error"]
