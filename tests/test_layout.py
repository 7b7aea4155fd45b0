"""The code's homes hold: layers as ARCHITECTURE.md draws them, product code free of test code.

Each check is run against the real tree, and the import contracts also against a small tree that
breaks them (so a contract that can no longer fail is caught too).
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("gateway", "controller", "reward", "trainer")
PRODUCT_SOURCES = [ROOT / "shared" / "src", *(ROOT / "services" / s / "src" for s in SERVICES)]
# Nothing a settings object needs: the stack builds every service's settings in its own process.
HEAVY = ("torch", "verl", "vllm", "litestar", "aiohttp", "uvicorn", "nats", "kubernetes")


def product_modules() -> list[Path]:
    return sorted(p for src in PRODUCT_SOURCES for p in src.rglob("*.py"))


def modules_loaded_by(module: str, then: str = "") -> set[str]:
    """Every module a fresh interpreter has loaded after importing `module` (and running `then`)."""
    probe = f"import sys, json, {module}\n{then}\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("service", SERVICES)
def test_settings_module_is_a_leaf(service: str) -> None:
    """Importing a service's settings loads neither torch, verl, vLLM nor the rest of the service."""
    loaded = modules_loaded_by(f"harnessrl.{service}.settings")
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}
    own = {m for m in loaded if m.startswith(f"harnessrl.{service}.")}
    assert own == {f"harnessrl.{service}.settings"}, own
    assert callable(importlib.import_module(f"harnessrl.{service}.settings").read_settings)


def test_the_harnessrl_command_builds_its_parser_without_torch_or_verl() -> None:
    """`harnessrl --help` loads every service's commands, but none of the heavy machinery."""
    loaded = modules_loaded_by("harnessrl.stack.cli", then="harnessrl.stack.cli.build_parser()")
    assert {"harnessrl.gateway.cli", "harnessrl.trainer.cli"} <= loaded
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "verl", "vllm")}


def test_the_leaf_probe_sees_heavy_imports() -> None:
    """The probe above is able to fail: the engine module does load torch and verl."""
    loaded = modules_loaded_by("harnessrl.trainer.engine")
    assert {"torch", "verl"} <= loaded


def test_product_code_defines_no_test_double_secret_or_benchmark() -> None:
    """No module under shared/src or services/*/src is a fake, a stub, a benchmark or a test secret."""
    suspicious = {"bench", "fake", "stub", "canned", "testing", "loadgen", "fixtures", "corpus"}
    offenders = [str(p.relative_to(ROOT)) for p in product_modules() if set(p.stem.split("_")) & suspicious]
    for path in product_modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.startswith(("Fake", "Stub", "Canned")):
                offenders.append(f"{path.relative_to(ROOT)}: class {node.name}")
            if isinstance(node, ast.Constant) and node.value in ("test-secret", "admin-token"):
                offenders.append(f"{path.relative_to(ROOT)}: secret {node.value!r}")
    assert offenders == []


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = [f"[importlinter]\nroot_packages =\n    {config['root_packages'][0]}\n"]
    for i, contract in enumerate(config["contracts"]):
        lines.append(f"[importlinter:contract:{i}]")
        for key, value in contract.items():
            text = "\n" + "\n".join(f"    {item}" for item in value) if isinstance(value, list) else value
            lines.append(f"{key} = {text}")
    (tree / ".importlinter").write_text("\n".join(lines) + "\n")
    lint = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(lint), "--config", ".importlinter", "--no-cache"],
        cwd=tree,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        check=False,
    )


def _package_tree(root: Path, imports: dict[str, str]) -> None:
    for package in ("shared", *SERVICES, "stack", "testkit", "benchmarks"):
        folder = root / "harnessrl" / package
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text(imports.get(package, ""))
    (root / "harnessrl" / "__init__.py").write_text("")


def test_import_contracts_pass_on_a_tree_that_keeps_the_layers(tmp_path: Path) -> None:
    _package_tree(
        tmp_path,
        {
            "stack": "import harnessrl.gateway\nimport harnessrl.shared\n",
            "gateway": "import harnessrl.shared\n",
            "testkit": "import harnessrl.stack\n",
            "benchmarks": "import harnessrl.testkit\n",
        },
    )
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("package", "source", "broken"),
    [
        ("shared", "import harnessrl.gateway\n", "shared imports neither a service nor the stack"),
        ("gateway", "import harnessrl.reward\n", "services are independent of each other"),
        ("trainer", "import harnessrl.stack\n", "layers"),
        ("controller", "import harnessrl.testkit\n", "no product package imports the test kit"),
        ("testkit", "import harnessrl.benchmarks\n", "the test kit imports no benchmark"),
    ],
)
def test_import_contracts_catch_a_crossed_layer(
    tmp_path: Path, package: str, source: str, broken: str
) -> None:
    _package_tree(tmp_path, {package: source})
    result = _lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    broken_lines = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(broken) for line in broken_lines), result.stdout


# ---------------------------------------------------------------------------------------------
# Every distribution a package imports is one its pyproject declares


def package_folders() -> dict[str, Path]:
    """Our product distributions and the folders holding their pyproject.toml."""
    folders = {"harnessrl-shared": ROOT / "shared"}
    return folders | {f"harnessrl-{s}": ROOT / "services" / s for s in SERVICES}


def declared(folder: Path) -> set[str]:
    """Distributions a pyproject declares (extras included), and those its own harnessrl-* ones declare."""
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {}).values()
    texts = [*project.get("dependencies", []), *(text for extra in extras for text in extra)]
    names = {canonicalize_name(Requirement(text).name) for text in texts}
    own = package_folders()
    return names | {d for name in names if name in own for d in declared(own[name])}


def imported_modules(src: Path) -> dict[str, set[str]]:
    """Module imported -> files importing it: top-level names, `harnessrl.<package>` for ours."""
    found: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                module = ".".join(parts[:2]) if parts[0] == "harnessrl" else parts[0]
                found.setdefault(module, set()).add(str(path.relative_to(src)))
    return found


def undeclared_imports(dist: str, folder: Path) -> dict[str, list[str]]:
    """Modules `dist` imports whose distribution its pyproject does not declare -> who imports them."""
    allowed = declared(folder) | {canonicalize_name(dist)}
    owners = metadata.packages_distributions()
    missing: dict[str, list[str]] = {}
    for module, files in imported_modules(folder / "src").items():
        if module.split(".")[0] in sys.stdlib_module_names or module == "__future__":
            continue
        ours = module.startswith("harnessrl.")
        providers = [module.replace(".", "-")] if ours else owners.get(module, [])
        if not {canonicalize_name(p) for p in providers} & allowed:
            missing[module] = sorted(files)
    return missing


@pytest.mark.parametrize("dist", sorted(package_folders()))
def test_every_distribution_a_package_imports_is_declared(dist: str) -> None:
    """A service's image installs only its declared closure: an import nobody declared fails there."""
    assert undeclared_imports(dist, package_folders()[dist]) == {}


def test_the_declaration_check_sees_an_undeclared_import(tmp_path: Path) -> None:
    """The check above can fail: a third-party, a sibling service and an unknown module are caught."""
    module = tmp_path / "src" / "harnessrl" / "demo" / "grader.py"
    module.parent.mkdir(parents=True)
    third_party = "import duckdb\nimport msgspec\nimport not_installed_anywhere\n"
    ours = "from harnessrl.shared import ids\nfrom harnessrl.reward import grading\nfrom . import peers\n"
    module.write_text(third_party + ours + "import os.path\n")
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "harnessrl-demo"\ndependencies = ["harnessrl-shared"]\n'
    )
    missing = undeclared_imports("harnessrl-demo", tmp_path)
    assert sorted(missing) == ["duckdb", "harnessrl.reward", "not_installed_anywhere"]
