"""`harnessrl tasks check FILE`: what would keep a task file's or dataset's rows from training.

Loads the rows as a run would (`harnessrl.controller.task_files.read_task_rows`, the flavour, split
and image mirror given) and prints one line per problem, `<instance_id>: <problem>` (the row's
place when it has no id), then `N rows, M ok, K with problems`; exits 1 when any row has one.
A problem is:

- a missing or malformed field, a duplicate id, a line that is not a JSON object;
- a row its flavour marks ungradable by the swebench rules (SWE-smith, R2E-Gym: the reason);
- with `--launcher`, a SWE row without what that launcher copies the repository from
  (`repo_path` locally, `image` in Kubernetes);
- with `--allow-image PREFIX` (repeatable), a task image under none of the prefixes;
- a SWE row no swebench log parser reads (`harnessrl.reward.swe.official.parser_name`: none for
  its `log_parser`, or for its repository): without one it cannot be graded officially. Our own
  rows (flavour `tasks`) without an `eval_script` are graded by the reward service's own pytest run
  and are not checked for one.

What stops the read itself (no such file, a split that is not there, rows of no single flavour)
is one `error:` line on stderr and exit 1. `--json` prints one object instead:
`{source, flavour, split, splits, rows, ok, with_problems, problems: [{id, where, problem}]}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from harnessrl.controller.task_files import REPOSITORY_SOURCES, TaskFileError, TaskRow, read_task_rows
from harnessrl.shared.datasetspec import DATASET_FLAVOURS, DatasetFlavour, DatasetSpec
from harnessrl.shared.taskpaths import BaseCommitError, check_base_commit

ParserLookup = Callable[[dict[str, Any]], str | None]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one row."""

    id: str
    where: str
    problem: str


@dataclass(frozen=True)
class CheckRules:
    """What a check asks of every row beyond loading: a launcher's repository source, image prefixes."""

    launcher: str | None = None
    allowed_images: tuple[str, ...] = ()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `harnessrl tasks check` to the `harnessrl` parser (into `tasks`, where a service made it)."""
    tasks = subparsers.choices.get("tasks") or subparsers.add_parser("tasks", help="task sets")
    verbs = _verbs(tasks) or tasks.add_subparsers(dest="tasks_command", required=True)
    check = verbs.add_parser(
        "check",
        help="load a task file or dataset as a run would; one line per problem, exit 1 if any",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("file", help="a JSONL or Parquet file, a hub folder or a save_to_disk folder")
    check.add_argument(
        "--flavour", choices=DATASET_FLAVOURS, default="auto", help="how to read the rows (default: detect)"
    )
    check.add_argument("--split", default=None, help="the split to read (default: the only one)")
    check.add_argument(
        "--launcher",
        choices=sorted(REPOSITORY_SOURCES),
        default=None,
        help="also check each SWE row has what this launcher copies the repository from",
    )
    check.add_argument(
        "--allow-image",
        action="append",
        default=[],
        metavar="PREFIX",
        help="task images must start with one of these (repeatable; default: any image)",
    )
    check.add_argument(
        "--image-prefix", default=None, metavar="REGISTRY", help="pull task images through this mirror"
    )
    check.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    check.set_defaults(func=cmd_tasks_check)


def _verbs(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser] | None:
    """The sub-command group `parser` already has (the reward service's `tasks build`), if any."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def cmd_tasks_check(args: argparse.Namespace) -> int:
    """Print every problem of the rows `args` name; 1 when there is any (or the rows cannot be read)."""
    flavour: DatasetFlavour = args.flavour
    spec = DatasetSpec(flavour=flavour, split=args.split, image_prefix=args.image_prefix)
    try:
        loaded = read_task_rows(args.file, spec)
    except TaskFileError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    rules = CheckRules(launcher=args.launcher, allowed_images=tuple(args.allow_image))
    problems = check_rows(loaded.rows, rules, official_parser())
    bad = len({p.where for p in problems})
    total = len(loaded.rows)
    if args.json:
        report = {
            "source": str(loaded.source),
            "flavour": loaded.flavour,
            "split": loaded.split,
            "splits": list(loaded.splits),
            "rows": total,
            "ok": total - bad,
            "with_problems": bad,
            "problems": [vars(p) for p in problems],
        }
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        lines = [f"{p.id or p.where}: {p.problem}\n" for p in problems]
        sys.stdout.write("".join(lines) + f"{total} rows, {total - bad} ok, {bad} with problems\n")
    return 1 if problems else 0


def official_parser() -> ParserLookup:
    """The swebench parser lookup (imported here: it loads swebench's grading modules)."""
    from harnessrl.reward.swe.official import parser_name

    return parser_name


def check_rows(rows: Sequence[TaskRow], rules: CheckRules, parser: ParserLookup) -> list[Problem]:
    """Every problem of every row, in row order."""
    return [
        Problem(row.task_id, row.where, problem)
        for row in rows
        for problem in row_problems(row, rules, parser)
    ]


def row_problems(row: TaskRow, rules: CheckRules, parser: ParserLookup) -> list[str]:
    """What keeps one row from training or from being graded (see the module docstring)."""
    if row.task is None:
        return list(row.problems)
    instance = row.task.instance or {}
    if row.task.kind != "swe":
        return []
    problems: list[str] = []
    if instance.get("ungradable"):
        problems.append(f"ungradable by the swebench rules: {instance['ungradable']}")
    if rules.launcher is not None:
        field = REPOSITORY_SOURCES[rules.launcher]
        if not instance.get(field):
            problems.append(
                f"lacks `{field}`, which the {rules.launcher} launcher copies the repository from"
            )
    if instance.get("base_commit") is not None and not instance.get("ungradable"):
        try:
            check_base_commit(str(instance["base_commit"]))
        except BaseCommitError as exc:
            problems.append(f"{exc}: no launcher or grader will check it out")
    image = str(instance.get("image") or "")
    if image and rules.allowed_images and not image.startswith(rules.allowed_images):
        problems.append(f"image {image!r} is not under an allowed prefix ({', '.join(rules.allowed_images)})")
    if not instance.get("ungradable") and _needs_parser(instance) and parser(instance) is None:
        problems.append(_no_parser(instance))
    return problems


def _needs_parser(instance: dict[str, Any]) -> bool:
    """Dataset rows are graded by swebench's rules; our own rows only when they bring an eval script."""
    return instance.get("flavour") is not None or bool(instance.get("eval_script"))


def _no_parser(instance: dict[str, Any]) -> str:
    named = instance.get("log_parser")
    wanted = f"log parser {named!r}" if named else f"log parser for repository {instance.get('repo', '')!r}"
    if instance.get("eval_script"):
        return f"swebench has no {wanted}, which its eval_script's log needs"
    return f"swebench has no {wanted} and the row has no eval_script: it cannot be graded officially"
