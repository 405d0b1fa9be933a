"""Hugging Face checkpoint folders <-> CausalLM (folders only; aliases: staleflow.model.loader).

    model = load_folder("/ckpt/qwen3-8b", torch.bfloat16, "cuda")
    save_hf(model, "/out/step-100", tokenizer_from="/ckpt/qwen3-8b")

A folder is config.json + safetensors (one `model.safetensors`, or shards listed in
`model.safetensors.index.json`). Tensor names are HF's and map 1:1 onto `CausalLM.state_dict()`.
Every failure is a one-line `ModelLoadError` naming the folder/file/tensor and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from staleflow.faults import BadInput
from staleflow.model.args import ModelArgs, ModelConfigError
from staleflow.model.meta import on_meta
from staleflow.model.transformer import CausalLM

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some old checkpoints carry


class ModelLoadError(BadInput, ValueError):
    """A model folder or checkpoint that cannot be loaded; the message says why and what to do."""


def _read_json(path: Path, limit: int = 16 << 20):
    from staleflow.inputs import InputError, load_json

    try:  # a regular file (a FIFO would hang the reader), at most `limit` bytes, any nesting refused cleanly
        return load_json(path, limit)
    except InputError as e:
        raise ModelLoadError(f"cannot read {str(path)!r}: {str(e)[:200]}") from None


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"no config.json in model folder {str(folder)!r}: is it a Hugging Face model folder?")
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: a JSON {type(config).__name__}, not an object")
    return config


def read_model_args(folder: str | Path) -> ModelArgs:
    """config.json decoded into typed, range-checked ModelArgs; one ModelLoadError naming the field."""
    try:
        return ModelArgs.from_hf_config(read_config(folder))
    except ModelConfigError as e:
        raise ModelLoadError(f"{folder}/config.json: {e}") from None
    except KeyError as e:
        raise ModelLoadError(f"{folder}/config.json lacks the required field {e.args[0]!r}") from None


def check_tokenizer_config(folder: str | Path) -> None:
    """The tokenizer's JSON files decode to objects of the expected types, and none asks for custom
    code (auto_map): transformers would run it, or ask on a terminal. One ModelLoadError otherwise."""
    from staleflow.inputs import special_file

    folder = Path(folder)
    for entry in folder.iterdir() if folder.is_dir() else ():  # tokenizer.json & co. are opened by libraries
        problem = special_file(entry) or ""
        if problem.startswith("is ") and not problem.startswith("is a folder"):  # a FIFO, a socket, a device
            raise ModelLoadError(f"{entry} {problem}: a model folder holds files (a FIFO would hang its reader)")
    for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        obj = _read_json(path)
        if not isinstance(obj, dict):
            raise ModelLoadError(f"{path}: a JSON {type(obj).__name__}, not an object")
        if "auto_map" in obj:
            raise ModelLoadError(
                f"{path}: field auto_map names custom tokenizer code, which staleflow never runs "
                f"(trust_remote_code=False): remove auto_map or use the model's standard tokenizer files"
            )
        for key, types in _TOKENIZER_FIELDS.items():
            if key in obj and obj[key] is not None and not isinstance(obj[key], types):
                raise ModelLoadError(f"{path}: field {key} is a {type(obj[key]).__name__}, not the type it must be")


_TOKENIZER_FIELDS = {
    "tokenizer_class": str,
    "chat_template": (str, list),
    "model_max_length": (int, float),
    "added_tokens_decoder": dict,
    "padding_side": str,
    "truncation_side": str,
}


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint files of a folder: the shards named by the index, else every *.safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return _index_shards(folder, index)
    from staleflow.inputs import special_file

    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        if problem := special_file(file):
            raise ModelLoadError(f"{file} {problem}: a model folder holds safetensors files")
    if not files:
        raise ModelLoadError(
            f"no *.safetensors in model folder {str(folder)!r}: convert the checkpoint to safetensors "
            f"(e.g. transformers save_pretrained(..., safe_serialization=True))"
        )
    return files


def _index_shards(folder: Path, index: Path) -> list[Path]:
    """The shard files model.safetensors.index.json names: typed (weight_map an object of tensor name
    -> file name), every file a plain name in the folder (no path, no '..': a hub snapshot's shards
    may be symlinks to its blobs) and a regular file; one ModelLoadError naming the index otherwise."""
    from staleflow.inputs import InputError, load_json, special_file

    try:
        obj = load_json(index)
    except InputError as e:
        raise ModelLoadError(f"cannot read the shard index: {e}") from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ModelLoadError(f"{index}: weight_map must be an object of tensor name -> shard file name")
    files = []
    for name in sorted(set(weight_map.values())):
        path = folder / name
        if not name or "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
            raise ModelLoadError(f"{index}: shard {name[:120]!r} is not a file name inside the model folder")
        problem = special_file(path)
        if problem == "does not exist":
            raise ModelLoadError(f"shard {name!r} listed in {str(index)!r} is missing from the folder")
        if problem:
            raise ModelLoadError(f"shard {name!r} listed in {str(index)!r} {problem}")
        files.append(path)
    return files


def check_headers(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every file's safetensors header parses and fits the file (reads headers only): a corrupted
    or truncated file is one ModelLoadError, on every rank alike, before any tensor is read.
    Returns every tensor's name and shape, from the headers."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ModelLoadError(
                f"{file} is not a readable safetensors file ({str(e).splitlines()[0][:160]}): "
                f"re-download or re-export the model"
            ) from None
    return shapes


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape a model of ``args`` has, without building it: one layer is built on
    the meta device and repeated (a config.json of a million layers costs nothing here)."""
    from staleflow.model.transformer import DecoderLayer

    with on_meta():
        one = CausalLM(args.replace(num_layers=1, mlp_only_layers=[]))
        kinds = {s: DecoderLayer(args, i) for i, s in _layer_kinds(args).items()}  # a dense and a sparse one
    out = {name: tuple(t.shape) for name, t in one.state_dict().items() if ".layers.0." not in name}
    layer_shapes = {s: {n: tuple(t.shape) for n, t in layer.state_dict().items()} for s, layer in kinds.items()}
    for i in range(args.num_layers):
        for n, shape in layer_shapes[args.is_moe_layer(i)].items():
            out[f"model.layers.{i}.{n}"] = shape
    return out


def _layer_kinds(args: ModelArgs) -> dict[int, bool]:
    """The first layer index of each kind (sparse or dense) the model has: {index: sparse}."""
    first: dict[bool, int] = {}
    for i in range(args.num_layers):
        first.setdefault(args.is_moe_layer(i), i)
        if len(first) == 2:
            break
    return {i: s for s, i in first.items()}


def check_config_against_headers(folder: str, args: ModelArgs, headers: dict[str, tuple[int, ...]]) -> None:
    """config.json must describe the weights: same tensors, same shapes (read from the headers only),
    before any model is built; else one ModelLoadError naming the field and the fix."""
    expected = expected_shapes(args)
    found = {
        n: s
        for n, s in headers.items()
        if not (n.endswith(_IGNORED_SUFFIXES) or (args.tie_word_embeddings and n == "lm_head.weight"))
    }
    layers = {int(n.split(".")[2]) for n in found if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    where = f"{folder}/config.json does not match the weights"
    if layers and len(layers) != args.num_layers:
        raise ModelLoadError(
            f"{where}: field num_hidden_layers is {args.num_layers}, the safetensors hold {len(layers)} layers"
        )
    embed = found.get("model.embed_tokens.weight")
    if embed is not None and embed != expected["model.embed_tokens.weight"]:
        raise ModelLoadError(
            f"{where}: fields vocab_size x hidden_size are {args.vocab_size} x {args.hidden_size}, "
            f"model.embed_tokens.weight is {' x '.join(map(str, embed))}"
        )
    for name, shape in found.items():
        if name in expected and shape != expected[name]:
            raise ModelLoadError(
                f"{where}: tensor {name!r} has shape {shape}, config.json implies {expected[name]} "
                f"(check hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim)"
            )
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint in {folder!r} does not match a {args.architecture} model: "
            f"{len(missing)} missing tensors {missing[:4]}, {len(unexpected)} unexpected tensors {unexpected[:4]}"
        )


def load_folder(folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> CausalLM:
    """Build a CausalLM from a HF folder and load its weights (cast to dtype, on device)."""
    model, weights = lazy_folder(folder, dtype, device)
    model.load_state_dict(dict(weights()), assign=True, strict=True)
    return model


def lazy_folder(folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu"):
    """The model of a HF folder on the meta device, and a function that streams its weights.

    ``weights()`` yields (name, tensor) one tensor at a time (cast to dtype, on device), each
    checked against the shape config.json implies; after the last one it raises ModelLoadError
    if a tensor was missing or unexpected. A sharded trainer fills only its own rows from it, so
    no rank ever holds the whole model (staleflow.train.trainer.Trainer(..., weights=...))."""
    folder = str(folder)
    args = read_model_args(folder)
    files = safetensors_files(folder)
    check_config_against_headers(folder, args, check_headers(files))
    check_tokenizer_config(folder)
    with on_meta():
        model = CausalLM(args)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    dev = torch.device(device)
    dev = f"cuda:{dev.index or 0}" if dev.type == "cuda" else str(dev)

    def weights():
        from safetensors import safe_open

        seen: set[str] = set()
        unexpected: list[str] = []
        for file in files:
            with safe_open(str(file), framework="pt", device=dev) as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (args.tie_word_embeddings and name == "lm_head.weight"):
                        continue
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    t = f.get_tensor(name)
                    if tuple(t.shape) != tuple(expected[name]):
                        raise ModelLoadError(
                            f"tensor {name!r} in {file.name} has shape {tuple(t.shape)}, config.json implies "
                            f"{tuple(expected[name])}: config and weights do not match"
                        )
                    seen.add(name)
                    yield name, (t.to(dtype) if t.is_floating_point() else t)
        missing = sorted(set(expected) - seen)
        if missing or unexpected:
            raise ModelLoadError(
                f"checkpoint in {folder!r} does not match a {args.architecture} model: "
                f"{len(missing)} missing tensors {missing[:4]}, {len(unexpected)} unexpected tensors "
                f"{sorted(unexpected)[:4]}"
            )

    return model, weights


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def save_hf(
    model: CausalLM,
    folder: str | Path,
    tokenizer_from: str | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write config.json + safetensors (sharded with an index above max_shard_bytes) into folder.

    `state_dict` overrides model.state_dict() (e.g. a full state dict gathered from FSDP shards).
    `tokenizer_from` (a folder) copies its tokenizer files and chat template alongside.
    Each file is written to a temporary name then renamed, so a crash never leaves a torn file.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = model.state_dict() if state_dict is None else state_dict
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    config = model.args.to_hf_config()
    config["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    config["dtype"] = config["torch_dtype"]  # transformers 5 spelling

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for stale in list(folder.glob("model*.safetensors")) + list(folder.glob("model.safetensors.index.json")):
        stale.unlink()
    metadata = {"format": "pt"}
    if len(shards) == 1:
        _atomic_write(folder / "model.safetensors", lambda p: save_file(shards[0], str(p), metadata=metadata))
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _atomic_write(folder / name, lambda p, s=shard: save_file(s, str(p), metadata=metadata))
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _atomic_write(folder / "model.safetensors.index.json", lambda p: p.write_text(json.dumps(index, indent=2)))

    generation = {"bos_token_id": model.args.bos_token_id, "eos_token_id": config["eos_token_id"]}
    _atomic_write(folder / "generation_config.json", lambda p: p.write_text(json.dumps(generation, indent=2)))
    if tokenizer_from is not None:
        src = Path(tokenizer_from)
        copied = [n for n in TOKENIZER_FILES if (src / n).is_file()]
        if not copied:
            raise ModelLoadError(
                f"tokenizer_from={tokenizer_from!r} has no tokenizer files ({TOKENIZER_FILES[0]}, ...)"
            )
        for n in copied:
            if (src / n).resolve() != (folder / n).resolve():
                _atomic_write(folder / n, lambda p, n=n: shutil.copyfile(src / n, p))
    # config.json last: a folder with a config.json is complete.
    _atomic_write(folder / "config.json", lambda p: p.write_text(json.dumps(config, indent=2)))
    return folder
