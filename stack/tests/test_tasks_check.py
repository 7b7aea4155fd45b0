"""`harnessrl tasks check`: one line per problem, a summary, exit 1 when any; run through `main`.

The rows are the controller's dataset fixtures (each dataset's shape as it ships), some edited here
to carry the problems the command names; the log-parser verdicts are swebench's own (5.0.2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harnessrl.stack.cli import main

DATA = Path(__file__).parents[2] / "services" / "controller" / "tests" / "data" / "datasets"


def rows_of(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def check(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, list[str], str]:
    """Run `harnessrl tasks check ARGS` as a user would: exit code, stdout lines, stderr."""
    capsys.readouterr()
    code = main(["tasks", "check", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_clean_datasets_pass(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = check(
        capsys, DATA / "swe-bench.jsonl", "--launcher", "kubernetes", "--allow-image", "swebench/"
    )
    assert (code, lines) == (0, ["3 rows, 3 ok, 0 with problems"])
    code, lines, _ = check(
        capsys, DATA / "swe-bench-multilingual.jsonl", "--flavour", "swe-bench-multilingual"
    )
    assert (code, lines) == (0, ["2 rows, 2 ok, 0 with problems"])
    code, lines, _ = check(capsys, DATA / "swe-rebench.jsonl")  # parse_log_pytest from install_config
    assert (code, lines) == (0, ["2 rows, 2 ok, 0 with problems"])


def test_every_problem_is_one_line_naming_the_instance(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rows = rows_of("swe-bench")
    del rows[0]["base_commit"]
    rows[1]["image"] = "ghcr.io/elsewhere/django:11099"
    rows[2]["repo"] = "acme/unknown"
    file = write_jsonl(tmp_path / "bench.jsonl", rows)
    code, lines, _ = check(
        capsys, file, "--flavour", "swe-bench", "--launcher", "kubernetes", "--allow-image", "swebench/"
    )
    assert code == 1
    assert lines == [
        "astropy__astropy-12907: lacks `base_commit`",
        "django__django-11099: image 'ghcr.io/elsewhere/django:11099' is not under an allowed prefix "
        "(swebench/)",
        "sympy__sympy-20590: swebench has no log parser for repository 'acme/unknown' and the row has no "
        "eval_script: it cannot be graded officially",
        "3 rows, 0 ok, 3 with problems",
    ]


def test_launcher_sources_and_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = check(capsys, DATA / "swe-gym.jsonl", "--flavour", "swe-gym", "--launcher", "local")
    assert code == 1
    assert lines == [
        "getmoto__moto-7365: lacks `repo_path`, which the local launcher copies the repository from",
        "getmoto__moto-7365: swebench has no log parser for repository 'getmoto/moto' and the row has no "
        "eval_script: it cannot be graded officially",
        "Project-MONAI__MONAI-3715: lacks `repo_path`, which the local launcher copies the repository from",
        "Project-MONAI__MONAI-3715: swebench has no log parser for repository 'Project-MONAI/MONAI' and the "
        "row has no eval_script: it cannot be graded officially",
        "2 rows, 0 ok, 2 with problems",
    ]


def test_a_named_parser_swebench_lacks_is_a_problem_even_with_an_eval_script(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rows = rows_of("swe-bench-multilingual")
    rows[0]["log_parser"] = "parse_log_nonexistent"
    code, lines, _ = check(
        capsys, write_jsonl(tmp_path / "ml.jsonl", rows), "--flavour", "swe-bench-multilingual"
    )
    assert (code, lines) == (
        1,
        [
            "jqlang__jq-2681: swebench has no log parser 'parse_log_nonexistent', which its eval_script's "
            "log needs",
            "2 rows, 1 ok, 1 with problems",
        ],
    )


@pytest.mark.parametrize(
    ("name", "reason"), [("swe-smith", "SWE-smith grades with"), ("r2e-gym", "R2E-Gym grades by")]
)
def test_rows_a_flavour_cannot_grade_are_reported(
    capsys: pytest.CaptureFixture[str], name: str, reason: str
) -> None:
    code, lines, _ = check(capsys, DATA / f"{name}.jsonl")
    assert code == 1
    assert len(lines) == 3 and lines[-1] == "2 rows, 0 ok, 2 with problems"
    assert all(f"ungradable by the swebench rules: {reason}" in line for line in lines[:2])


def test_unreadable_lines_and_duplicates_are_problems_too(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    file = tmp_path / "t.jsonl"
    file.write_text('{"task_id": "a", "prompt": "x"}\n[1]\n{"task_id": "a", "prompt": "y"}\n')
    code, lines, _ = check(capsys, file, "--flavour", "tasks")
    assert code == 1
    assert lines == [
        f"{file}:2: expected a JSON object, got list",
        f"a: duplicate task id 'a' (first at {file}:1)",
        "3 rows, 1 ok, 2 with problems",
    ]


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = check(
        capsys, DATA / "swe-gym.jsonl", "--flavour", "swe-gym", "--json", "--image-prefix", "m.local",
        "--allow-image", "m.local/xingyaoww/",
    )  # fmt: skip
    assert code == 1
    (line,) = lines
    report = json.loads(line)
    assert {k: report[k] for k in ("flavour", "split", "rows", "ok", "with_problems")} == {
        "flavour": "swe-gym",
        "split": None,
        "rows": 2,
        "ok": 0,
        "with_problems": 2,
    }
    assert len(report["problems"]) == 2  # the mirrored images are allowed: only the parsers are missing
    assert report["problems"][0] == {
        "id": "getmoto__moto-7365",
        "where": f"{DATA / 'swe-gym.jsonl'}:1",
        "problem": "swebench has no log parser for repository 'getmoto/moto' and the row has no eval_script: "
        "it cannot be graded officially",
    }


def test_a_read_that_cannot_happen_is_an_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, err = check(capsys, DATA / "swe-gym.jsonl")
    assert (code, lines) == (1, [])
    assert err.startswith("error: ") and "fit flavours swe-bench or swe-gym" in err
    code, _, err = check(capsys, DATA / "swe-bench.jsonl", "--split", "test")
    assert code == 1 and "a single file without split 'test' (available: none)" in err


@pytest.mark.parametrize("base", ["--orphan=x", "main; id", "HEAD~1"])
def test_a_base_commit_that_is_not_a_commit_id_is_a_problem(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, base: str
) -> None:
    rows = rows_of("swe-bench")
    rows[1]["base_commit"] = base
    code, lines, _ = check(capsys, write_jsonl(tmp_path / "sb.jsonl", rows), "--flavour", "swe-bench")
    assert code == 1
    assert lines[-1] == f"{len(rows)} rows, {len(rows) - 1} ok, 1 with problems"
    assert lines[0] == (
        f"{rows[1]['instance_id']}: base_commit {base!r} is not a commit id (7 to 40 lowercase hex digits): "
        "no launcher or grader will check it out"
    )
