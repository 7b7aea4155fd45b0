"""The commands of a README, as its reader would type them: which fenced blocks run, and in what order.

The convention (stated for readers in `examples/README.md`):

- A fenced block tagged `sh` holds commands that `tests/test_readme_commands.py` runs exactly as
  written, from the repository root. Every other tag (`text`, `toml`, `python`, ...) is shown, not
  run: templates, diagrams, code to read. A block without a tag is an error, so nobody adds a
  command that silently goes unrun.
- `sh background ready="TEXT"` is a command for a second terminal (say `harnessrl up`): it keeps
  running while the section's later blocks run, the next block starts once TEXT appeared in its
  output, and after the section's last block it gets Ctrl-C.
- The `sh` blocks under one heading are one section: they run in order, in one fresh copy of the
  repository, each block in its own `bash` that stops at the first failing command.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import msgspec

RUN_TAG = "sh"
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.+?)\s*#*\s*$")
TRAIN = re.compile(r"^(\s*harnessrl\s+train\s.*?)(\s+#.*)?$")


class ReadmeError(ValueError):
    """A README breaks the convention; the message names the file and line."""


class Block(msgspec.Struct, frozen=True, kw_only=True):
    """One fenced block of a README."""

    line: int  # 1-based line of the opening fence
    tag: str  # the info string's first word ("" when there is none)
    text: str
    heading: str  # the nearest heading above it ("" before the first one)
    background: bool = False
    ready: str = ""  # background: the output that says it is ready

    @property
    def runs(self) -> bool:
        """Whether the test runs this block."""
        return self.tag == RUN_TAG


class Section(msgspec.Struct, frozen=True, kw_only=True):
    """The `sh` blocks under one heading of one README: one scenario, run in one copy of the repo."""

    readme: str  # path relative to the repository root
    heading: str
    blocks: list[Block]

    @property
    def id(self) -> str:
        """`path#anchor`, the way GitHub links to the heading."""
        return f"{self.readme}#{anchor(self.heading)}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _attributes(info: str, where: str) -> dict[str, str | bool]:
    """`background` and `ready="..."` from the rest of an info string."""
    found: dict[str, str | bool] = {}
    for word in shlex.split(info):
        name, has_value, value = word.partition("=")
        if name == "background" and not has_value:
            found["background"] = True
        elif name == "ready" and has_value:
            found["ready"] = value
        else:
            raise ReadmeError(f"{where}: unknown block attribute {word!r} (known: background, ready=TEXT)")
    if bool(found.get("background")) != bool(found.get("ready")):
        raise ReadmeError(f'{where}: a background block needs ready="TEXT", and only it takes one')
    return found


def blocks(markdown: str, source: str = "<markdown>") -> list[Block]:
    """Every fenced block of `markdown`, with the heading it sits under."""
    found: list[Block] = []
    heading, opened = "", None
    body: list[str] = []
    number = 0
    for number, line in enumerate(markdown.splitlines(), start=1):
        fence = FENCE.match(line)
        if opened is not None:
            if fence and _closes(fence, opened):
                found.append(_block(opened, number - len(body) - 1, body, heading, source))
                opened, body = None, []
            else:
                body.append(line)
        elif fence:
            opened = fence
        elif title := HEADING.match(line):
            heading = title[2]
    if opened is not None:
        raise ReadmeError(f"{source}:{number - len(body)}: a fenced block is never closed")
    return found


def _closes(fence: re.Match[str], opened: re.Match[str]) -> bool:
    """A closing fence: the same character, at least as long, no info string."""
    return fence[1][0] == opened[1][0] and len(fence[1]) >= len(opened[1]) and not fence[2].strip()


def _block(fence: re.Match[str], line: int, body: list[str], heading: str, source: str) -> Block:
    tag, _, rest = fence[2].strip().partition(" ")
    where = f"{source}:{line}"
    attributes = _attributes(rest, where) if tag == RUN_TAG else {}
    return Block(line=line, tag=tag, text="\n".join(body) + "\n", heading=heading, **attributes)  # type: ignore[arg-type]


def sections(readme: Path, root: Path) -> list[Section]:
    """The runnable sections of one README, in reading order; an untagged block is an error."""
    relative = readme.relative_to(root).as_posix()
    found: dict[str, list[Block]] = {}
    for block in blocks(readme.read_text(), relative):
        if not block.tag:
            raise ReadmeError(
                f"{relative}:{block.line}: a fenced block without a tag: "
                f"tag it `{RUN_TAG}` (a test runs it) or `text` (shown only)"
            )
        if block.runs:
            found.setdefault(block.heading, []).append(block)
    return [Section(readme=relative, heading=h, blocks=b) for h, b in found.items()]


def shorten(text: str, max_steps: int) -> str:
    """`text` with `--max-steps N` on every `harnessrl train` line that does not already say how long.

    The README says `--max-steps N` is how to try a run shorter than its spec asks; this is the one
    change the test makes to a command.
    """
    return "".join(_shorten_line(line, max_steps) + "\n" for line in text.splitlines())


def _shorten_line(line: str, max_steps: int) -> str:
    train = TRAIN.match(line)
    if train is None or "--max-steps" in line or line.rstrip().endswith("\\"):
        return line
    return f"{train[1]} --max-steps {max_steps}{train[2] or ''}"
