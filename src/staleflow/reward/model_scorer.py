"""A learned reward: a Hugging Face sequence-classification model that scores (prompt, response).

    check_reward_model_folder("/models/Skywork-Reward-V2-Llama-3.1-8B")   # one RewardError line if unusable
    scorer = RewardModelScorer(folder, device="cpu", dtype="auto", max_tokens=4096)
    scorer.score(["What is 2 + 3?"], ["5"])                              # -> [float], one per pair

The folder must be what transformers loads as ``AutoModelForSequenceClassification`` with
``trust_remote_code=False`` from safetensors only: nothing in it may run code (no ``auto_map``
in config.json or the tokenizer's files, no pickle ``.bin`` weights). One label: its logit is the
score. Each pair is rendered as the reward model's tokenizer expects: with a chat template, the
conversation [user: prompt, assistant: response]; without, ``prompt + "\\n\\n" + response``. A
pair longer than ``max_tokens`` loses its beginning, never its end (a sequence classifier scores
the last token). Pairs are scored in right-padded batches; the padding id is one that occurs in
none of the batch's sequences, so the classifier's "last token that is not padding" is always the
last real token, even when the tokenizer pads with its end-of-text token.

RewardModelPool (reward/model_pool.py) runs this in processes of its own.
"""

from __future__ import annotations

from pathlib import Path

from staleflow.reward.functions import RewardError

SEQ_CLS = "ForSequenceClassification"


def check_reward_model_folder(folder: str) -> dict:
    """The folder's config.json (a dict) if it is a reward model this runs; else one RewardError
    naming what is wrong and the fix. Reads JSON files only: no model code is imported here."""
    from staleflow.model.hf import ModelLoadError, check_tokenizer_config, read_config

    flag = f"--reward.model={folder!r}"
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise RewardError(f"{flag}: no such folder: give a Hugging Face sequence-classification model folder")
    try:
        config = read_config(path)
        check_tokenizer_config(path)
    except ModelLoadError as e:
        raise RewardError(f"{flag}: {e}") from None
    if "auto_map" in config:
        raise RewardError(f"{flag}: config.json names custom model code (auto_map), which staleflow never runs")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not any(isinstance(a, str) and a.endswith(SEQ_CLS) for a in archs):
        raise RewardError(
            f"{flag}: its architectures {archs!r} hold no *{SEQ_CLS}: a reward model is a sequence classifier "
            f"(e.g. LlamaForSequenceClassification with one label), not a causal LM"
        )
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 1)
    if labels != 1:
        raise RewardError(f"{flag}: it has {labels} labels; a reward model has one (its logit is the score)")
    if not any(path.glob("*.safetensors")):
        raise RewardError(f"{flag}: no *.safetensors weights (pickle .bin files are never loaded): convert it")
    return config


def resolve_dtype(setting: str, device: str):
    import torch

    if setting == "float32":
        return torch.float32
    if setting == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


class RewardModelScorer:
    """The model and its tokenizer, loaded once; ``score`` is one batched forward per call."""

    def __init__(self, folder: str, device: str = "cpu", dtype: str = "auto", max_tokens: int = 4096):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_reward_model_folder(folder)
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        self.tokenizer.truncation_side = "left"  # keep the response's end: the classifier reads the last token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            folder, trust_remote_code=False, use_safetensors=True, dtype=resolve_dtype(dtype, device)
        )
        self.model.to(self.device).eval().requires_grad_(False)
        self.vocab = int(self.model.get_input_embeddings().num_embeddings)

    def render(self, prompt: str, response: str) -> tuple[str, bool]:
        """(text, whether it is a rendered chat: then it carries its own special tokens)."""
        if getattr(self.tokenizer, "chat_template", None):
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(chat, tokenize=False), True
        return f"{prompt}\n\n{response}", False

    def encode(self, prompts: list[str], responses: list[str]) -> list[list[int]]:
        out = []
        for p, r in zip(prompts, responses, strict=True):
            text, chat = self.render(p, r)
            ids = self.tokenizer(text, add_special_tokens=not chat, truncation=True, max_length=self.max_tokens)
            out.append(list(ids["input_ids"]))
        return out

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One float per (prompt, response), in order."""
        import torch

        seqs = self.encode(prompts, responses)
        if any(not s for s in seqs):
            raise RewardError("the reward model's tokenizer produced an empty sequence")
        used = {t for s in seqs for t in s}
        pad = next(i for i in range(self.vocab + 1) if i not in used)  # occurs in no sequence of the batch
        if pad >= self.vocab:
            raise RewardError(
                "every token id of the reward model's vocabulary occurs in the batch: lower the batch size"
            )
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        for config in {id(c): c for c in (self.model.config, self.model.config.get_text_config())}.values():
            config.pad_token_id = pad
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return [float(x) for x in logits[:, 0].float().cpu()]
