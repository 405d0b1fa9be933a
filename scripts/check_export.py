"""Check a finished run's exported Hugging Face folder against the trainer's own weights.

    python scripts/check_export.py runs/<id>

Loads `runs/<id>/hf` with transformers (what a user does with the result) and the newest
training checkpoint of the same run into StaleFlow's model, then compares logits on a few
prompts (fp32, max |diff| <= 1e-3) and every exported tensor with the checkpoint's (exactly
equal). Reports how far training moved the weights from the starting model (0 is possible in a
two-step run where every reward of a group was equal). Prints one JSON line; exits 1 if a check
fails. CI runs it after the two-step first run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--tol", type=float, default=1e-3)
    args = ap.parse_args()
    import transformers

    from staleflow.model import PackedAttention, cu_seqlens_from_lengths, load_model, load_tokenizer, packed_positions
    from staleflow.train.checkpoint import latest_checkpoint, load_policy_weights

    run = Path(args.run_dir)
    hf_dir, cfg_file = run / "hf", run / "config.json"
    if not (hf_dir / "config.json").is_file() or not cfg_file.is_file():
        print(
            f"check_export: {run} has no hf/config.json or config.json: is it a finished run folder?", file=sys.stderr
        )
        return 1
    model_path = json.loads(cfg_file.read_text())["model"]["path"]
    ckpt = latest_checkpoint(run / "checkpoints")
    if ckpt is None:
        print(f"check_export: no checkpoint under {run}/checkpoints", file=sys.stderr)
        return 1
    start = load_model(model_path)
    trainer_model = load_model(model_path)
    load_policy_weights(trainer_model, ckpt)
    moved = max(
        (a - b).abs().max().item() for a, b in zip(trainer_model.state_dict().values(), start.state_dict().values())
    )
    from safetensors import safe_open

    from staleflow.model.hf import safetensors_files

    exported = {}
    for f in safetensors_files(hf_dir):
        with safe_open(str(f), framework="pt") as fh:
            exported.update({k: fh.get_tensor(k) for k in fh.keys()})
    trained = trainer_model.state_dict()
    tensors_equal = set(exported) == set(trained) and all(torch.equal(exported[k], trained[k]) for k in trained)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, trust_remote_code=False
    ).eval()
    tok = load_tokenizer(str(hf_dir))
    texts = ["What is 12 + 30?", "The capital of France is", "1, 2, 3, 4,"]
    worst = 0.0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor(tok.encode(text))
            cu = cu_seqlens_from_lengths([len(ids)])
            ours = trainer_model.compute_logits(trainer_model(ids, packed_positions(cu), PackedAttention(cu)))
            theirs = ref(ids[None]).logits[0]
            worst = max(worst, (ours - theirs).abs().max().item())
    ok = worst <= args.tol and tensors_equal
    print(
        json.dumps(
            {
                "run": str(run),
                "checkpoint": ckpt.name,
                "max_logit_diff": worst,
                "tol": args.tol,
                "tensors_equal": tensors_equal,
                "weights_moved_max": moved,
                "ok": ok,
            }
        )
    )
    if not ok:
        why = (
            "exported tensors differ from the checkpoint's"
            if not tensors_equal
            else "transformers' logits on the export differ from the trainer's"
        )
        print(f"check_export: FAILED: {why}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
