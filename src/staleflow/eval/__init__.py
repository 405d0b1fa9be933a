"""staleflow.eval: evaluate a policy on a task, alone (``python -m staleflow eval``) or inside a run.

    python -m staleflow eval --model runs/<run>/hf --data.source arithmetic-easy --n 256
    python -m staleflow eval --model smollm2-135m --data.source data.jsonl --reward.fn math --samples 8

- scoring.py: what "correct" means (answer reward >= 1) and the summary of an evaluation
  (accuracy, 95% interval, pass@K), shared with the main job's held-out evaluation
  (runtime/evaluation.py); the intervals themselves are metrics/stats.py.
- runner.py: answers prompts with the project's own rollout engine (greedy or K samples each).
- command.py: the ``eval`` subcommand (its flags, model and data resolution, one JSON line).

See docs/evaluation.md.
"""
