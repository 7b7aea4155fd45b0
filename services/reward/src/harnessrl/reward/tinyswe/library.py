"""The libraries tinyswe is built from: text bundles of files, loaded by name."""

from __future__ import annotations

from importlib import resources

import msgspec

_MARKER = "### "
_BUNDLES = "harnessrl.reward.tinyswe.libraries"


class Library(msgspec.Struct, frozen=True, kw_only=True):
    """One library: its name and every file (path -> text), scaffolding included."""

    name: str
    files: dict[str, str]

    def sources(self) -> list[str]:
        """Paths of the library's own modules (the mutation targets), sorted."""
        return sorted(p for p in self.files if p.startswith(f"{self.name}/") and p.endswith(".py"))

    def test_files(self) -> list[str]:
        """Paths of the test modules, sorted."""
        return sorted(p for p in self.files if p.startswith("tests/") and p.endswith(".py"))


def parse_bundle(text: str) -> dict[str, str]:
    """Split a bundle (`### path` lines, each followed by that file's text) into files."""
    files: dict[str, str] = {}
    path: str | None = None
    lines: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith(_MARKER):
            if path is not None:
                files[path] = "".join(lines)
            path, lines = line[len(_MARKER) :].strip(), []
        elif path is not None:
            lines.append(line)
    if path is not None:
        files[path] = "".join(lines)
    return files


def scaffold(name: str) -> dict[str, str]:
    """Project files every library repository has: packaging, pytest configuration, README."""
    return {
        "pyproject.toml": (
            f'[project]\nname = "{name}"\nversion = "0.1.0"\nrequires-python = ">=3.11"\n\n'
            '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["."]\n'
        ),
        "README.md": f"# {name}\n\nA small stdlib-only library. Run the tests with `pytest`.\n",
        ".gitignore": "__pycache__/\n*.pyc\n",
    }


def load_libraries() -> list[Library]:
    """Every bundled library, sorted by name."""
    folder = resources.files(_BUNDLES)
    libraries = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".txt"):
            name = entry.name.removesuffix(".txt")
            files = scaffold(name) | parse_bundle(entry.read_text(encoding="utf-8"))
            libraries.append(Library(name=name, files=files))
    return libraries
