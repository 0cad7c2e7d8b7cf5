"""The alerting rules in ``examples/dashboard/alerts.yml`` (#28): they load (``promtool check
rules``), and on synthetic series each fires when it should and not before
(``promtool test rules tests/alerts_test.yml``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from reliable_sub.testing.services import missing_service

TESTS = Path(__file__).resolve().parent
RULES = TESTS.parent / "examples" / "dashboard" / "alerts.yml"
TIMEOUT = 60.0


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    executable = shutil.which("promtool")
    if executable is None:
        missing_service("promtool is not on PATH (Debian package prometheus)")
    assert executable is not None
    return subprocess.run([executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)


def test_the_rules_load() -> None:
    checked = promtool("check", "rules", str(RULES), cwd=TESTS)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 5 rules found" in checked.stdout


def test_each_alert_fires_when_it_should_and_not_before() -> None:
    tested = promtool("test", "rules", "alerts_test.yml", cwd=TESTS)
    assert tested.returncode == 0, tested.stdout + tested.stderr
