"""The servers a run shares among its workers (tests/shared_servers.py) start once, however
many ask at once, and are killed at the end of the run."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from tests import shared_servers


def test_a_shared_server_starts_once_for_concurrent_callers_and_is_killed_at_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(shared_servers.ENVIRONMENT, str(tmp_path))
    started: list[subprocess.Popen[bytes]] = []

    def start(directory: Path) -> dict[str, Any]:
        assert directory.is_dir()
        started.append(subprocess.Popen(["sleep", "600"]))
        return {"pid": started[-1].pid}

    records: list[dict[str, Any]] = []
    callers = [threading.Thread(target=lambda: records.append(shared_servers.shared("s", start)))
               for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(started) == 1
    assert records == [{"pid": started[0].pid}] * 4

    shared_servers.kill_all(tmp_path)
    assert started[0].poll() is not None, "killed and reaped"
    assert not tmp_path.exists()


def test_a_failed_start_is_tried_again_by_the_next_caller(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(shared_servers.ENVIRONMENT, str(tmp_path))

    def fail(directory: Path) -> dict[str, Any]:
        raise AssertionError("the server did not start")

    with pytest.raises(AssertionError, match="did not start"):
        shared_servers.shared("s", fail)
    assert shared_servers.shared("s", lambda _: {"pid": os.getpid()}) == {"pid": os.getpid()}
