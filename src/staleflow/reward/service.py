"""RewardService: the run's reward, a rule (``--reward.fn``), a reward model (``--reward.model``) or
both by weights, behind RewardPool's non-blocking interface. What the controller's backend uses.

    rewards = RewardService(cfg.reward, trainer_ranks=[0])
    rewards.submit(key, completion_text, answer, meta, prompt=prompt_text)
    for key, reward, info in rewards.poll(): ...

Without ``--reward.model`` it is the RewardPool of ``--reward.fn``, unchanged. With it:

    reward = rule_weight * rule_reward + model_weight * model_score

where the rule part is skipped (no rule workers) when ``--reward.rule-weight`` is 0. A key is
returned once both parts are in. If either part failed (an error, a timeout, a dead worker), the
key's reward is 0 with that part's ``info["error"]``: the run's reward-error handling counts it
as any failed reward (--reward.max-consecutive-failures). ``info`` carries ``rule_reward`` and
``model_score`` besides the rule's own fields.
"""

from __future__ import annotations

from staleflow.reward.pool import RewardPool


class RewardService:
    def __init__(self, cfg, trainer_ranks=()):
        self.cfg = cfg
        self.use_model = bool(cfg.model)
        self.rule = RewardPool(cfg) if (not self.use_model or cfg.rule_weight > 0) else None
        self.model = None
        if self.use_model:
            from staleflow.reward.model_pool import RewardModelPool

            try:
                self.model = RewardModelPool(cfg, trainer_ranks)
            except BaseException:
                if self.rule is not None:
                    self.rule.close()
                raise
        self._parts: dict = {}  # key -> {"rule": (reward, info), "model": (score, info)} until both are in
        self._needs = tuple(n for n, p in (("rule", self.rule), ("model", self.model)) if p is not None)
        self._submitted = self._returned = 0

    def submit(self, key, completion_text: str, answer: str, meta: dict | None = None, prompt: str = "") -> None:
        self._submitted += 1
        if self.rule is not None:
            self.rule.submit(key, completion_text, answer, meta)
        if self.model is not None:
            self.model.submit(key, prompt, completion_text)

    def poll(self, timeout: float = 0.0) -> list[tuple[object, float, dict]]:
        if not self.use_model:
            return self.rule.poll(timeout)
        got = []
        for name in self._needs:
            pool = getattr(self, name)
            got += [(name, r) for r in pool.poll(timeout if not got else 0.0)]
        out = []
        for name, (key, value, info) in got:
            parts = self._parts.setdefault(key, {})
            parts[name] = (value, info)
            if len(parts) == len(self._needs):
                out.append(self._combine(key, self._parts.pop(key)))
        self._returned += len(out)
        return out

    def _combine(self, key, parts: dict) -> tuple[object, float, dict]:
        cfg = self.cfg
        rule_r, rule_info = parts.get("rule", (0.0, {}))
        score, model_info = parts.get("model", (0.0, {}))
        info = {**rule_info, "rule_reward": rule_r, "model_score": score}
        error = rule_info.get("error") or model_info.get("error")
        if error:
            return key, 0.0, {**info, "error": error}
        return key, cfg.rule_weight * rule_r * (self.rule is not None) + cfg.model_weight * score, info

    def drain(self, timeout: float) -> list[tuple[object, float, dict]]:
        import time

        deadline, out = time.monotonic() + timeout, []
        while self.pending() and time.monotonic() < deadline:
            out += self.poll(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
        return out + self.poll()

    def pending(self) -> int:
        """Submitted keys not yet returned by poll."""
        return self.rule.pending() if not self.use_model else self._submitted - self._returned

    def close(self) -> None:
        for pool in (self.rule, self.model):
            if pool is not None:
                pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self) -> dict:
        out = {}
        for pool in (self.rule, self.model):
            if pool is not None:
                out.update(pool.stats())
        return out
