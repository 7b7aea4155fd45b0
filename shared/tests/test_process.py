"""`proc_stat`: the fields of /proc/<pid>/stat, read past a command name that holds spaces and ')'."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from harnessrl.shared.process import proc_stat


def test_fields_start_at_the_state_even_when_the_command_name_holds_spaces_and_parens(tmp_path: Path) -> None:
    odd = tmp_path / "a b) c"
    shutil.copy(sys.executable, odd)
    odd.chmod(0o755)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        fields = proc_stat(child.pid)
        assert fields is not None
        assert fields[0] in ("R", "S", "D"), fields[:3]
        assert int(fields[1]) == os.getpid() and int(fields[2]) == child.pid
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_has_no_fields() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert proc_stat(child.pid) is None
