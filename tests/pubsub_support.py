"""The official Pub/Sub emulator, started once per test run on a free loopback port.

``emulator_host()`` starts ``cloud-pubsub-emulator`` (Debian package
``google-cloud-cli-pubsub-emulator``, needs a JDK) on first use, waits until it accepts
connections, sets ``PUBSUB_EMULATOR_HOST`` and stops it when the test process exits. Without the
emulator the calling test is skipped on a laptop and fails under ``CI=true``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

PACKAGE = "google-cloud-cli-pubsub-emulator"
KNOWN_LAUNCHER = "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"
# The JVM starts in a few seconds here; allow for a loaded CI machine.
START_TIMEOUT = 60.0

_state: dict[str, object] = {}


def launcher() -> str | None:
    """Path of the emulator's launcher, found the way SERVICES.md says (dpkg -L)."""
    found = shutil.which("cloud-pubsub-emulator")
    if found:
        return found
    try:
        listing = subprocess.run(["dpkg", "-L", PACKAGE], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        listing = []
    for line in listing:
        if line.endswith("bin/cloud-pubsub-emulator"):
            return line
    return KNOWN_LAUNCHER if os.path.exists(KNOWN_LAUNCHER) else None


def emulator_host() -> str:
    """``host:port`` of a running emulator (started on first use); skip or fail without one."""
    if "host" in _state:
        return str(_state["host"])
    problem = _start()
    if problem is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{problem} (CI=true: a missing service is a failure, not a skip)")
        pytest.skip(problem)
    return str(_state["host"])


def _start() -> str | None:
    path = launcher()
    if path is None:
        return f"the Pub/Sub emulator is not installed (apt-get install {PACKAGE})"
    port = _free_port()
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the emulator writes to it until exit
        prefix="pubsub-emulator-", suffix=".log", delete=False
    )
    process = subprocess.Popen(
        [path, "--host=127.0.0.1", f"--port={port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    atexit.register(_stop, process)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"the Pub/Sub emulator exited with {process.returncode}; see {log.name}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)  # polling a port with a deadline, not synchronisation
    else:
        _stop(process)
        return f"the Pub/Sub emulator did not listen on {port} within {START_TIMEOUT}s"
    host = f"127.0.0.1:{port}"
    os.environ["PUBSUB_EMULATOR_HOST"] = host
    _state.update(host=host, process=process)
    return None


def restart() -> None:
    """Kill the emulator and start it again on the same port (all its state is lost)."""
    process = _state.pop("process")
    host = str(_state.pop("host"))
    assert isinstance(process, subprocess.Popen)
    _stop(process)
    port = int(host.rsplit(":", 1)[1])
    path = launcher()
    assert path is not None
    new = subprocess.Popen([path, "--host=127.0.0.1", f"--port={port}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    atexit.register(_stop, new)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    _state.update(host=host, process=new)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
