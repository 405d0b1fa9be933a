"""Environments for end-to-end tests with tiny random models (--env.name e2e_envs:NAME).

A random model never calls a tool, so these environments answer every turn themselves: the
trajectory has turns and observations whatever the model writes.
"""

import asyncio

from staleflow.env import EnvStep


class SleepyEnv:
    """Three turns: steps 1 and 2 "run a tool" for 50 ms and answer with its result; step 3 ends the
    episode. Its state (the step count) is recreated by replaying the messages."""

    def __init__(self, cfg):
        self.cfg, self.steps = cfg, 0

    async def reset(self, prompt):
        self.steps = 0

    async def step(self, message):
        self.steps += 1
        if self.steps >= 3:
            return EnvStep("", done=True)
        await asyncio.sleep(0.05)
        return EnvStep(f"tool result {self.steps}: {len(message)} characters", done=False, tool_calls=1, tool_s=0.05)
