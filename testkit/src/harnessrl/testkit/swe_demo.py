"""The coding demo's warm-started policy for tests, built once per machine.

Two training instances of the demo's task family, with two captured-format trajectories each (the
fix and a failed edit), imitated long enough that sampling at temperature 1 makes the fix in some
episodes and not in others: GRPO groups then have reward variance. Cached under the machine cache,
keyed on the base model, the demonstrations, the arguments and the warm-start source.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from harnessrl.shared.cache import build_once, cache_root
from harnessrl.stack.demo import swe_demos, swe_tasks
from harnessrl.stack.demo.swe_run import capture_reference
from harnessrl.testkit.policies import fingerprint

TRAIN_TASKS = 2
# Measured (teacher-forced log-probs of the four demonstrations): after 150 steps the tiny model still
# mixed the two edits' continuations (`$(git` then `&&`), a second coin flip that left about one
# episode in five making the fix (3 of 16 here, 0 of 16 on a CI machine); after 300 steps at lr 5e-3
# to 7e-3 the choice of file is the only uncertain token (p 0.4 to 0.6), the rest above 0.99.
WARM_STEPS, WARM_LR = 300, "6e-3"


class SweDemoPolicy:
    """The policy and what it was taught.

    The rows, mini's configuration, the captured request and the demonstrations, by name
    (`<instance>/fix` and `<instance>/wrong`).
    """

    def __init__(
        self,
        rows: list[dict[str, Any]],
        config: Path,
        captured: dict[str, Any],
        demos: dict[str, swe_demos.Demo],
        model: Path,
    ) -> None:
        self.rows, self.config, self.captured, self.demos, self.model = rows, config, captured, demos, model


def swe_demo_policy(tiny_model: Path, home: Path) -> SweDemoPolicy:
    """Warm-start the tiny model on fixes and failed edits of `TRAIN_TASKS` training instances."""
    from harnessrl.trainer import warmstart

    rows = swe_tasks.load_rows(swe_tasks.ensure_split("train", 40))[:TRAIN_TASKS]
    config = swe_demos.write_config(home / "mini-demo.yaml")
    captured = capture_reference(swe_demos.MINI_SWE_AGENT, config, rows[0])
    reference = swe_tasks.spec_of(rows[0])
    demos = {
        f"{row['instance_id']}/{kind}": swe_demos.replay(captured, reference, swe_tasks.spec_of(row), edit)
        for row in rows
        for kind, edit in (
            ("fix", swe_tasks.spec_of(row).fix_command()),
            ("wrong", swe_demos.wrong_fix(swe_tasks.spec_of(row))),
        )
    }
    lines = "\n".join(json.dumps(d) for d in demos.values()).encode()
    args = ["--steps", str(WARM_STEPS), "--batch", str(len(demos)), "--lr", WARM_LR, "--threads", "2"]
    digest = hashlib.sha256(lines + " ".join(args).encode())
    target = cache_root() / "swe-demo-policy" / fingerprint(digest, tiny_model, [Path(warmstart.__file__)])

    def build(staging: Path) -> None:
        (staging / "demos.jsonl").write_bytes(lines)
        warm = [sys.executable, "-m", "harnessrl.trainer.warmstart", "--model", str(tiny_model),
                "--demos", str(staging / "demos.jsonl"), "--out", str(staging), *args]  # fmt: skip
        subprocess.run(warm, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    return SweDemoPolicy(rows, config, captured, demos, build_once(target, build, done="config.json"))
