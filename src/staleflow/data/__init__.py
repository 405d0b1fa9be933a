"""staleflow.data: the prompt source of a run (built-in generated tasks or .jsonl / .parquet files).

    from staleflow.data import PromptSource
    source = PromptSource(cfg.data, tokenizer)    # tokenizer = staleflow.model.load_tokenizer(...)
    prompt = next(source)                         # Prompt(prompt_id, text, answer, prompt_ids, meta)
    ckpt["data"] = source.state_dict()            # resumable position

See docs/data-and-rewards.md.
"""

from staleflow.data.files import BadRow, DataError, FileRow, read_rows
from staleflow.data.source import PromptSource
from staleflow.data.tasks import TASKS, TaskError, arithmetic_row, countdown_row, register_task, task_for
from staleflow.trajectory import Prompt

__all__ = [
    "BadRow",
    "DataError",
    "FileRow",
    "Prompt",
    "PromptSource",
    "TASKS",
    "TaskError",
    "arithmetic_row",
    "countdown_row",
    "read_rows",
    "register_task",
    "task_for",
]
