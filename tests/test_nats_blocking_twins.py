"""The NATS adapter's blocking twins in a plain script: it publishes and exits without
``close_sync()``, and the interpreter's exit prints nothing about the adapter's background loop
(#24, item 16b). Before, nats-py's reader, pinger and flusher tasks were destroyed pending when
the loop was closed at exit: "Task was destroyed but it is pending!" and "Event loop is closed"
tracebacks on every run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.nats_processes import NatsServer

pytest.importorskip("nats", reason='the NATS tests need "reliable-sub[nats]"')

NOISE = ("Task was destroyed but it is pending", "Event loop is closed", "Exception ignored")
# Real seconds the script may take (it connects, creates a stream and publishes).
SCRIPT_TIMEOUT = 60


def run_script(
    tmp_path: Path, source: str, *, resource_warnings: bool = True,
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    # ResourceWarnings shown: an unclosed socket would be noise of its own
    options = ["-W", "default::ResourceWarning"] if resource_warnings else []
    return subprocess.run([sys.executable, *options, str(script)],
                          capture_output=True, text=True, timeout=SCRIPT_TIMEOUT)


def test_a_script_that_publishes_and_exits_without_close_sync_prints_no_noise(
    nats_server: NatsServer, tmp_path: Path,
) -> None:
    prefix = f"exit-{uuid.uuid4().hex[:8]}"
    result = run_script(tmp_path, f"""
        from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter

        broker = NatsJetStreamAdapter({nats_server.url!r}, prefix={prefix!r})
        broker.ensure_subscription_sync({prefix!r}, "billing")
        broker.ensure_topic_sync({prefix + "-dlq"!r})
        print(broker.publish_sync({prefix!r}, b"order-1"))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"
    noise = [line for line in result.stderr.splitlines() if any(n in line for n in NOISE)]
    assert noise == [], result.stderr
    assert result.stderr == ""


def test_a_script_that_publishes_from_threads_and_exits_prints_no_noise(
    nats_server: NatsServer, tmp_path: Path,
) -> None:
    """The twins are called from worker threads (a sync web app's); the main thread exits
    while the background loop still holds their connection."""
    prefix = f"exit-{uuid.uuid4().hex[:8]}"
    result = run_script(tmp_path, f"""
        from concurrent.futures import ThreadPoolExecutor

        from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter

        broker = NatsJetStreamAdapter({nats_server.url!r}, prefix={prefix!r})
        broker.ensure_subscription_sync({prefix!r}, "billing")
        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(lambda n: broker.publish_sync({prefix!r}, b"%d" % n), range(20)))
        print(len(set(ids)))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "20"
    assert result.stderr == ""


def test_an_adapter_dropped_before_exit_leaves_no_noise_either(
    nats_server: NatsServer, tmp_path: Path,
) -> None:
    """The adapter is garbage before exit (made and used in a function): its background loop
    still ends what runs on it. (Its socket is then closed by the garbage collector, with a
    ResourceWarning that Python shows only when asked to.)"""
    prefix = f"exit-{uuid.uuid4().hex[:8]}"
    result = run_script(tmp_path, f"""
        import gc

        from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter

        def publish() -> str:
            broker = NatsJetStreamAdapter({nats_server.url!r}, prefix={prefix!r})
            broker.ensure_subscription_sync({prefix!r}, "billing")
            return broker.publish_sync({prefix!r}, b"order-1")

        print(publish())
        gc.collect()
    """, resource_warnings=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"
    assert result.stderr == ""
