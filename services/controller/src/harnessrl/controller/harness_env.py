"""The environment a harness starts with: where the model API is, what the task is, its key.

The plain part goes into the launch request (a Job template may show it); the key variables go
separately, so the Kubernetes launcher can keep them in a per-episode Secret.
"""

from __future__ import annotations

import json

from harnessrl.controller.records import EpisodeRecord
from harnessrl.controller.settings import ControllerSettings
from harnessrl.controller.task_files import harness_view
from harnessrl.shared.contracts import TaskSpec


def episode_env(
    settings: ControllerSettings, base: dict[str, str], record: EpisodeRecord, task: TaskSpec, model: str
) -> dict[str, str]:
    """The harness's plain environment: where the model API is and what the task is."""
    gateway = settings.gateway_url.rstrip("/")
    env = dict(base)
    env.update(
        OPENAI_BASE_URL=f"{gateway}/v1",
        ANTHROPIC_BASE_URL=gateway,
        HARNESSRL_GATEWAY_URL=gateway,
        HARNESSRL_RUN=record.run,
        HARNESSRL_EPISODE=record.episode,
        HARNESSRL_TASK=task.prompt,
        HARNESSRL_TASK_ID=task.task_id,
        HARNESSRL_TASK_JSON=json.dumps(harness_view(task)),
        HARNESSRL_ARTIFACT="patch" if task.kind == "swe" else "answer",
    )
    if model:
        env["HARNESSRL_MODEL"] = model
    return env


def key_env(key: str) -> dict[str, str]:
    """The variables that carry the episode key (kept out of Job templates)."""
    return {"OPENAI_API_KEY": key, "ANTHROPIC_API_KEY": key, "HARNESSRL_EPISODE_KEY": key}
