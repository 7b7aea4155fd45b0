"""SWE datasets as they ship: every flavour normalised to the grader's row, every layout read.

The fixtures under `data/datasets/` are rows in the shape each dataset really ships (SWE-bench's
tests as JSON text, SWE-smith's bug patch and `image_name`, R2E-Gym's `expected_output_json`,
SWE-rebench's `install_config` and `docker_image`); the Parquet files and `save_to_disk` folders
are written from them here, with pyarrow and the `datasets` library, into `tmp_path`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harnessrl.controller.dataset_flavours import R2E_GYM_UNGRADABLE, SWE_FIELDS, SWE_SMITH_UNGRADABLE
from harnessrl.controller.errors import DatasetError
from harnessrl.controller.task_files import (
    TaskFileError,
    check_repository_sources,
    harness_view,
    load_tasks,
    read_task_rows,
)
from harnessrl.shared.contracts import RunSpec, decode, encode
from harnessrl.shared.datasetspec import DatasetSpec
from harnessrl.shared.runspec import RunSpecError, load_run_spec, parse_run_spec

DATA = Path(__file__).parent / "data" / "datasets"


def rows_of(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(name: str, **spec: Any) -> dict[str, dict[str, Any]]:
    """The fixture `name` loaded as a run would, each task's instance by id."""
    tasks = load_tasks(DATA / f"{name}.jsonl", DatasetSpec(**spec))
    return {task.task_id: task.instance or {} for task in tasks}


# --- each flavour ----------------------------------------------------------------------------------


def test_swe_bench_rows_decode_their_tests_and_name_the_official_image() -> None:
    tasks = load_tasks(DATA / "swe-bench.jsonl", DatasetSpec(flavour="swe-bench"))
    first = tasks[0]
    assert (first.task_id, first.kind, first.grader) == ("astropy__astropy-12907", "swe", "swebench")
    assert first.prompt.startswith("Modeling's `separability_matrix`")
    row = first.instance or {}
    assert set(SWE_FIELDS) <= set(row)
    assert row["FAIL_TO_PASS"] == [
        "astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6]",
        "astropy/modeling/tests/test_separable.py::test_separable[compound_model9-result9]",
    ]
    assert len(row["PASS_TO_PASS"]) == 3
    assert row["image"] == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert (row["version"], row["repo_dir"], row["eval_script"], row["flavour"]) == (
        "4.3",
        "/testbed",
        "",
        "swe-bench",
    )
    assert row["environment_setup_commit"] == "298ccb478e6bf092953bca67a3d29dc6c35f6752"  # kept
    assert row["ungradable"] == ""
    assert harness_view(first) == {
        "task_id": "astropy__astropy-12907",
        "kind": "swe",
        "prompt": first.prompt,
        "repo": "astropy/astropy",
        "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "instance_id": "astropy__astropy-12907",
    }
    images = {task.task_id: (task.instance or {})["image"] for task in tasks}
    assert images["django__django-11099"] == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"


def test_multilingual_rows_keep_their_image_eval_script_and_parser() -> None:
    rows = load("swe-bench-multilingual", flavour="swe-bench-multilingual")
    jq = rows["jqlang__jq-2681"]
    assert jq["image"] == "swebench/sweb.eval.x86_64.jqlang_1776_jq-2681:latest"
    assert (jq["log_parser"], jq["eval_type"], jq["FAIL_TO_PASS"]) == (
        "parse_log_jq",
        "pass_and_fail",
        ["tests/jqtest"],
    )
    assert ">>>>> Start Test Output" in jq["eval_script"]
    assert rows["tokio-rs__tokio-4867"]["log_parser"] == "parse_log_cargo"


def test_swe_gym_images_are_xingyaoww_with_s_and_lower_case() -> None:
    rows = load("swe-gym", flavour="swe-gym")
    assert rows["getmoto__moto-7365"]["image"] == "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest"
    monai = rows["Project-MONAI__MONAI-3715"]
    assert monai["image"] == "xingyaoww/sweb.eval.x86_64.project-monai_s_monai-3715:latest"
    assert monai["FAIL_TO_PASS"] == [
        "tests/test_prepare_batch_default.py::TestPrepareBatchDefault::test_evaluator_mode"
    ]


def test_swe_smith_rows_use_image_name_keep_the_bug_patch_and_are_marked_ungradable(tmp_path: Path) -> None:
    rows = load("swe-smith", flavour="swe-smith")
    oauth = rows["oauthlib__oauthlib.1fd52536.combine_file__09vmzh3e"]
    assert oauth["image"] == "jyangballin/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536"
    assert oauth["patch"] == "" and oauth["bug_patch"].startswith("diff --git a/oauthlib/")
    assert oauth["ungradable"] == SWE_SMITH_UNGRADABLE
    assert oauth["repo"] == "swesmith/oauthlib__oauthlib.1fd52536"
    # Without `image_name`, the profile's rule: swebench/swesmith.x86_64.<owner>_1776_<repo>.<commit8>.
    bare = [{k: v for k, v in row.items() if k != "image_name"} for row in rows_of("swe-smith")]
    tasks = load_tasks(write_jsonl(tmp_path / "smith.jsonl", bare), DatasetSpec(flavour="swe-smith"))
    assert [(t.instance or {})["image"] for t in tasks] == [
        "swebench/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536",
        "swebench/swesmith.x86_64.mahmoud_1776_glom.fb3c4e76",
    ]


def test_r2e_gym_rows_get_an_id_their_base_commit_and_the_reason_they_cannot_be_graded() -> None:
    rows = load("r2e-gym", flavour="r2e-gym")
    aiohttp = rows["aiohttp__f0d74880deec8fcd982bce639c93c5e130d41198"]
    assert aiohttp["image"] == "namanjain12/aiohttp_final:f0d74880deec8fcd982bce639c93c5e130d41198"
    assert aiohttp["repo"] == "aiohttp"
    assert aiohttp["base_commit"] == "0d5f4e8b5e4dbba9b61ac1c0b5d4e0e8f86e5ff1"  # parsed_commit_content's old
    assert (aiohttp["FAIL_TO_PASS"], aiohttp["PASS_TO_PASS"]) == ([], [])
    assert json.loads(aiohttp["expected_output_json"])["TestPartReader.test_read"] == "PASSED"  # kept
    assert aiohttp["ungradable"] == R2E_GYM_UNGRADABLE


def test_swe_rebench_rows_use_docker_image_else_the_swerebench_rule_and_the_config_parser() -> None:
    rows = load("swe-rebench", flavour="swe-rebench")
    assert rows["tobymao__sqlglot-1177"]["image"] == "swerebench/sweb.eval.x86_64.tobymao_1776_sqlglot-1177"
    assert (
        rows["reata__sqllineage-438"]["image"]
        == "swerebench/sweb.eval.x86_64.reata_1776_sqllineage-438:latest"
    )
    assert rows["reata__sqllineage-438"]["log_parser"] == "parse_log_pytest"  # from install_config
    assert rows["tobymao__sqlglot-1177"]["install_config"]["python"] == "3.9"


def test_a_rows_own_image_wins_and_a_mirror_moves_every_image(tmp_path: Path) -> None:
    gym = rows_of("swe-gym")
    gym[0]["image"] = "registry.local/gym/moto:7365"
    own = load_tasks(write_jsonl(tmp_path / "gym.jsonl", gym), DatasetSpec(flavour="swe-gym"))
    assert (own[0].instance or {})["image"] == "registry.local/gym/moto:7365"
    mirrored = load_tasks(
        write_jsonl(tmp_path / "gym.jsonl", gym),
        DatasetSpec(flavour="swe-gym", image_prefix="mirror.local:5000"),
    )
    assert [(t.instance or {})["image"] for t in mirrored] == [
        "mirror.local:5000/gym/moto:7365",  # its registry replaced
        "mirror.local:5000/xingyaoww/sweb.eval.x86_64.project-monai_s_monai-3715:latest",  # Docker Hub's
    ]
    own_rows = load_tasks(DATA / "tasks.jsonl", DatasetSpec(flavour="tasks", image_prefix="mirror.local"))
    assert (own_rows[1].instance or {})["image"] == "mirror.local/task:widget-1"


# --- auto-detection --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "flavour"),
    [
        ("swe-bench", "swe-bench"),
        ("swe-bench-multilingual", "swe-bench"),  # normalised the same way
        ("swe-smith", "swe-smith"),
        ("r2e-gym", "r2e-gym"),
        ("swe-rebench", "swe-rebench"),
        ("tasks", "tasks"),
    ],
)
def test_auto_detects_the_flavour_from_the_fields(name: str, flavour: str) -> None:
    loaded = read_task_rows(DATA / f"{name}.jsonl", DatasetSpec())
    assert loaded.flavour == flavour
    assert all(row.task is not None for row in loaded.rows)


def test_auto_refuses_rows_that_fit_flavours_naming_images_differently() -> None:
    with pytest.raises(
        DatasetError, match=r"swe-gym.jsonl: the rows fit flavours swe-bench or swe-gym.*--flavour"
    ):
        read_task_rows(DATA / "swe-gym.jsonl", DatasetSpec())
    assert read_task_rows(DATA / "swe-gym.jsonl", DatasetSpec(flavour="swe-gym")).flavour == "swe-gym"


def test_auto_refuses_a_file_mixing_flavours(tmp_path: Path) -> None:
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [rows_of("swe-smith")[0], rows_of("r2e-gym")[0]])
    with pytest.raises(DatasetError, match=r"mixed.jsonl:1: swe-smith; .*mixed.jsonl:2: r2e-gym"):
        read_task_rows(mixed, DatasetSpec())


def test_without_a_dataset_spec_rows_load_as_our_own() -> None:
    """Existing run specs (no `dataset`) read their JSONL exactly as before."""
    qa, swe = load_tasks(DATA / "tasks.jsonl")
    assert (qa.kind, swe.kind) == ("qa", "swe")
    assert swe.instance == rows_of("tasks")[1]  # kept as it is: no flavour fields added
    with pytest.raises(TaskFileError, match=r"swe-bench.jsonl:1: SWE-bench row lacks repo_path or image"):
        load_tasks(DATA / "swe-bench.jsonl")


# --- layouts, splits, filters, limits --------------------------------------------------------------


@pytest.fixture
def hub(tmp_path: Path) -> Path:
    """SWE-rebench rows as the hub ships them: data/<split>-00000-of-00001.parquet."""
    rows = rows_of("swe-rebench")
    (tmp_path / "hub" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "hub" / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[1:]), tmp_path / "hub" / "data" / "test-00000-of-00001.parquet")
    return tmp_path / "hub"


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """The same rows written by `DatasetDict.save_to_disk` with two splits."""
    rows = rows_of("swe-rebench")
    splits = {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows[1:])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


def test_a_parquet_file_reads_like_its_jsonl(tmp_path: Path) -> None:
    file = tmp_path / "rebench.parquet"
    pq.write_table(pa.Table.from_pylist(rows_of("swe-rebench")), file)
    from_parquet = load_tasks(file, DatasetSpec(flavour="swe-rebench"))
    from_jsonl = load_tasks(DATA / "swe-rebench.jsonl", DatasetSpec(flavour="swe-rebench"))
    assert [t.task_id for t in from_parquet] == [t.task_id for t in from_jsonl]
    for parquet_task, jsonl_task in zip(from_parquet, from_jsonl, strict=True):
        for field in (*SWE_FIELDS, "install_config", "meta"):
            assert (parquet_task.instance or {})[field] == (jsonl_task.instance or {})[field], field


def test_hub_folder_splits_come_from_the_file_names(hub: Path) -> None:
    test = read_task_rows(hub, DatasetSpec(split="test"))
    assert (test.flavour, test.split, test.splits) == ("swe-rebench", "test", ("test", "train"))
    assert [row.task_id for row in test.rows] == ["reata__sqllineage-438"]
    assert test.rows[0].where.endswith("data/test-00000-of-00001.parquet row 1")
    train = load_tasks(hub, DatasetSpec(split="train"))
    assert [t.task_id for t in train] == ["tobymao__sqlglot-1177"]
    with pytest.raises(DatasetError, match=r"has splits test, train: name one \(`dataset.split`, --split\)"):
        load_tasks(hub, DatasetSpec())


def test_save_to_disk_folder_reads_each_split_and_lists_them_when_one_is_wrong(saved: Path) -> None:
    test = read_task_rows(saved, DatasetSpec(split="test"))
    assert (test.flavour, test.splits) == ("swe-rebench", ("train", "test"))
    (row,) = test.rows
    assert row.task is not None and row.task_id == "reata__sqllineage-438"
    assert row.where == f"{saved}/test/data-00000-of-00001.arrow row 1"
    instance = row.task.instance or {}
    assert instance["FAIL_TO_PASS"] == ["tests/sql/table/test_cte.py::test_cte_insert_overwrite"]
    assert instance["install_config"]["log_parser"] == "parse_log_pytest"
    assert instance["image"] == "swerebench/sweb.eval.x86_64.reata_1776_sqllineage-438:latest"
    assert [t.task_id for t in load_tasks(saved, DatasetSpec(split="train"))] == ["tobymao__sqlglot-1177"]
    with pytest.raises(DatasetError, match=r"has no split 'validation'; available: train, test"):
        load_tasks(saved, DatasetSpec(split="validation"))


def test_a_single_saved_dataset_has_no_splits(tmp_path: Path) -> None:
    datasets.Dataset.from_list(rows_of("swe-bench")).save_to_disk(str(tmp_path / "one"))
    tasks = load_tasks(tmp_path / "one", DatasetSpec(flavour="swe-bench"))
    assert [t.task_id for t in tasks] == [
        "astropy__astropy-12907",
        "django__django-11099",
        "sympy__sympy-20590",
    ]
    assert (tasks[0].instance or {})["FAIL_TO_PASS"][0].endswith("[compound_model6-result6]")
    with pytest.raises(DatasetError, match=r"without splits; drop the split \('test'\)"):
        load_tasks(tmp_path / "one", DatasetSpec(split="test"))


def test_filters_and_limit_select_rows() -> None:
    by_glob = load_tasks(DATA / "swe-bench.jsonl", DatasetSpec(instances=["django__*", "sympy__sympy-2059?"]))
    assert [t.task_id for t in by_glob] == ["django__django-11099", "sympy__sympy-20590"]
    by_repo = load_tasks(DATA / "swe-bench.jsonl", DatasetSpec(repos=["sympy/sympy", "astropy/astropy"]))
    assert [t.task_id for t in by_repo] == ["astropy__astropy-12907", "sympy__sympy-20590"]
    both = load_tasks(DATA / "swe-bench.jsonl", DatasetSpec(instances=["*__*"], repos=["django/django"]))
    assert [t.task_id for t in both] == ["django__django-11099"]
    assert [t.task_id for t in load_tasks(DATA / "swe-bench.jsonl", DatasetSpec(limit=2))] == [
        "astropy__astropy-12907",
        "django__django-11099",
    ]
    filtered_first = load_tasks(DATA / "swe-bench.jsonl", DatasetSpec(instances=["s*", "d*"], limit=1))
    assert [t.task_id for t in filtered_first] == ["django__django-11099"]  # the limit counts kept rows
    with pytest.raises(TaskFileError, match="no tasks"):
        load_tasks(DATA / "swe-bench.jsonl", DatasetSpec(repos=["psf/requests"]))


# --- bad input -------------------------------------------------------------------------------------


def test_a_missing_field_names_the_field_and_the_line(tmp_path: Path) -> None:
    rows = rows_of("swe-bench")
    del rows[1]["base_commit"]
    with pytest.raises(TaskFileError, match=r"bad.jsonl:2: lacks `base_commit`$"):
        load_tasks(write_jsonl(tmp_path / "bad.jsonl", rows), DatasetSpec(flavour="swe-bench"))
    smith = rows_of("swe-smith")
    smith[0]["problem_statement"] = ""
    with pytest.raises(TaskFileError, match=r"smith.jsonl:1: lacks `problem_statement`"):
        load_tasks(write_jsonl(tmp_path / "smith.jsonl", smith), DatasetSpec(flavour="swe-smith"))


def test_a_missing_field_in_parquet_names_the_row(tmp_path: Path) -> None:
    rows = rows_of("swe-rebench")
    rows[1]["FAIL_TO_PASS"] = None
    file = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), file)
    with pytest.raises(TaskFileError, match=r"train-00000-of-00001.parquet row 2: lacks `FAIL_TO_PASS`"):
        load_tasks(file, DatasetSpec(flavour="swe-rebench", split="train"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("FAIL_TO_PASS", "[not json", r"`FAIL_TO_PASS` is not a JSON list of test ids"),
        ("PASS_TO_PASS", '{"a": 1}', r"`PASS_TO_PASS` must be a list of test ids, got dict"),
    ],
)
def test_malformed_test_lists_name_the_field(tmp_path: Path, field: str, value: str, message: str) -> None:
    rows = rows_of("swe-bench")
    rows[0][field] = value
    with pytest.raises(TaskFileError, match=r"t.jsonl:1: " + message):
        load_tasks(write_jsonl(tmp_path / "t.jsonl", rows), DatasetSpec(flavour="swe-bench"))


def test_unreadable_inputs_say_why(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_tasks(tmp_path / "nope.jsonl", DatasetSpec())
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: no dataset here"):
        load_tasks(tmp_path / "empty", DatasetSpec())
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"cannot read Parquet file .*broken.parquet"):
        load_tasks(tmp_path / "broken.parquet", DatasetSpec(flavour="swe-bench"))
    rows = [json.dumps(rows_of("swe-bench")[0]), "{not json"]
    (tmp_path / "half.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(TaskFileError, match=r"half.jsonl:2: not JSON"):
        load_tasks(tmp_path / "half.jsonl", DatasetSpec(flavour="swe-bench"))
    duplicated = write_jsonl(tmp_path / "dup.jsonl", rows_of("swe-gym") + rows_of("swe-gym")[:1])
    with pytest.raises(
        TaskFileError, match=r"dup.jsonl:3: duplicate task id 'getmoto__moto-7365' \(first at .*:1\)"
    ):
        load_tasks(duplicated, DatasetSpec(flavour="swe-gym"))


def test_each_launcher_needs_its_repository_source_from_dataset_rows() -> None:
    tasks = load_tasks(DATA / "swe-bench.jsonl", DatasetSpec(flavour="swe-bench"))
    check_repository_sources(tasks, "kubernetes", "run r")
    with pytest.raises(TaskFileError, match=r"3 swe task\(s\) lack `instance.repo_path`.*local launcher"):
        check_repository_sources(tasks, "local", "run r")


# --- the run spec's `dataset` ----------------------------------------------------------------------


def test_run_spec_names_a_dataset_folder_and_how_to_read_it(tmp_path: Path, saved: Path) -> None:
    (tmp_path / "run.toml").write_text(
        'run = "rebench"\ntasks = "saved"\n[launcher]\nkind = "kubernetes"\nimage = "harness:1"\n'
        'command = ["mini"]\n[dataset]\nflavour = "swe-rebench"\nsplit = "test"\n'
        'repos = ["reata/sqllineage"]\nlimit = 5\nimage_prefix = "mirror.local"\n'
    )
    spec = load_run_spec(tmp_path / "run.toml")
    assert spec.tasks == str(saved) and spec.dataset is not None
    assert decode(encode(spec), RunSpec) == spec  # crosses the bus intact
    (task,) = load_tasks(spec.tasks, spec.dataset)
    assert (task.instance or {})[
        "image"
    ] == "mirror.local/swerebench/sweb.eval.x86_64.reata_1776_sqllineage-438:latest"


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ({"flavour": "swe-bench-pro"}, "Invalid enum value 'swe-bench-pro' - at `$.dataset.flavour`"),
        ({"limit": 0}, "Expected `dataset.limit` >= 1"),
        ({"instances": ["", "a*"]}, "`dataset.instances` without empty entries"),
        ({"image_prefix": "/"}, "`dataset.image_prefix` to name a registry"),
    ],
)
def test_bad_dataset_fields_are_validation_errors_naming_the_field(
    dataset: dict[str, Any], message: str
) -> None:
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.convert({"run": "r", "tasks": "t.jsonl", "dataset": dataset}, RunSpec)
    assert message in str(caught.value)
    with pytest.raises(RunSpecError, match="submitted"):
        parse_run_spec(
            {"run": "r", "tasks": "t.jsonl", "launcher": {"command": ["x"]}, "dataset": dataset},
            source="submitted",
        )


def test_an_unknown_dataset_key_is_named() -> None:
    with pytest.raises(RunSpecError, match=r"unknown field\(s\) `dataset.flavor`"):
        parse_run_spec(
            {"run": "r", "tasks": "t", "launcher": {"command": ["x"]}, "dataset": {"flavor": "auto"}}
        )
