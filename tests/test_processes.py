"""The /proc readers the local runs end and inspect processes by (localserve.processes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from localserve.processes import (
    STAT_NICE,
    STAT_PPID,
    STAT_SESSION,
    STAT_STATE,
    every_process,
    process_name,
    session_members,
    stat_fields,
    with_descendants,
)

# A command name with the characters that break a naive split of /proc/<pid>/stat.
AWKWARD_NAME = "a) b (c"


@pytest.fixture
def awkward_child(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    program = tmp_path / AWKWARD_NAME
    shutil.copy(shutil.which("sleep") or "/bin/sleep", program)
    child = subprocess.Popen([str(program), "30"], preexec_fn=lambda: os.nice(3))
    yield child
    child.kill()
    child.wait()


def test_stat_fields_survive_a_name_with_parentheses_and_spaces(awkward_child: subprocess.Popen[bytes]) -> None:
    assert process_name(awkward_child.pid) == AWKWARD_NAME
    fields = stat_fields(awkward_child.pid)
    assert fields is not None
    assert int(fields[STAT_PPID]) == os.getpid()
    assert int(fields[STAT_SESSION]) == os.getsid(0)
    assert int(fields[STAT_NICE]) == os.getpriority(os.PRIO_PROCESS, 0) + 3


def test_the_tree_and_the_session_find_the_child(awkward_child: subprocess.Popen[bytes]) -> None:
    assert awkward_child.pid in with_descendants({os.getpid()})
    assert awkward_child.pid in session_members(os.getsid(0))
    assert awkward_child.pid in dict(every_process())


def test_a_process_that_is_gone_reads_as_none() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert stat_fields(gone.pid) is None
    assert process_name(gone.pid) is None


def test_an_exited_child_not_yet_reaped_is_no_member_of_its_session() -> None:
    # A Ray cluster's processes, killed after their leader, are zombies until init reaps them;
    # counted as members, every stop went on killing them until its deadline.
    child = subprocess.Popen(["true"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while (fields := stat_fields(child.pid)) is not None and fields[STAT_STATE] != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        assert fields is not None and fields[STAT_STATE] == "Z", "reaped before it could be looked at"
        assert session_members(child.pid) == []
    finally:
        child.wait()
