"""How a prompt becomes the token ids the policy sees.

    render = PromptRenderer(cfg.data, tokenizer)
    ids = render.encode(["What is 2 + 2?", (("system", "Be brief."), ("user", "Hi"))])

A string prompt becomes [system message (--data.system-prompt)] + the user message (with
--data.prompt-template around it, '{prompt}' replaced by the text); a chat-message prompt
((role, content), ...) is used as is. Then the tokenizer's own chat template with the generation
prompt (--data.chat-template, the default), else the contents joined by blank lines, tokenised with
the tokenizer's special tokens (a chat-message prompt then is an error: it needs the template).
With ``tools`` (a multi-turn run's tool schemas, staleflow.env.env_schemas) the template shows them
(its own ``tools=``, else the system-prompt fallback of env/template.py; docs/multi-turn.md).
"""

from __future__ import annotations

from staleflow.config import DataConfig
from staleflow.data.files import DataError


class PromptRenderer:
    def __init__(self, cfg: DataConfig, tokenizer, tools: list[dict] = (), tool_format: str = "auto"):
        if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "--data.chat-template is on but the tokenizer has no chat template: "
                "use an instruct model folder or pass --data.no-chat-template"
            )
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tools, self.tool_format = list(tools), tool_format

    def messages(self, prompt) -> list[dict]:
        """The chat messages of one prompt (a string or ((role, content), ...))."""
        if isinstance(prompt, str):
            cfg = self.cfg
            text = cfg.prompt_template.replace("{prompt}", prompt) if cfg.prompt_template else prompt
            system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
            return [*system, {"role": "user", "content": text}]
        return [{"role": r, "content": c} for r, c in prompt]

    def encode(self, prompts: list) -> list[list[int]]:
        """Token ids of prompts (strings or chat-message tuples) as the policy sees them."""
        if self.cfg.chat_template:
            from staleflow.env.template import TemplateBudgetError, render_chat, tool_messages

            rendered = []
            for p in prompts:
                msgs, extra = tool_messages(self.tokenizer, self.messages(p), self.tools, self.tool_format)
                try:  # the model folder's template, within a time, step and memory budget
                    rendered.append(render_chat(self.tokenizer, msgs, add_generation_prompt=True, **extra))
                except TemplateBudgetError as e:
                    raise DataError(str(e)) from None
            return [list(x) for x in self.tokenizer(rendered, add_special_tokens=False)["input_ids"]]
        texts = []
        for p in prompts:
            if not isinstance(p, str):
                raise DataError(
                    "a prompt given as chat messages needs the tokenizer's chat template: drop --data.no-chat-template"
                )
            texts.append("\n\n".join([*self._tool_text(), *(m["content"] for m in self.messages(p))]))
        return [list(x) for x in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]

    def _tool_text(self) -> list[str]:
        """Without a chat template: the tools' description as the first paragraph."""
        if not self.tools:
            return []
        from staleflow.env.template import fallback_system_prompt, resolve_tool_format

        return [fallback_system_prompt(self.tools, resolve_tool_format(self.tokenizer, self.tool_format))]
