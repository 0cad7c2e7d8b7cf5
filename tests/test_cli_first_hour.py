"""The CLI's first-hour gaps (#47): ``--json`` before the subcommand, a missing subscription's
error naming the key prefix it was looked up under, and ``top`` (or ``stats --watch``) ended
with Ctrl-C as the normal end of a watch: exit 0, no "Aborted!"."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from reliable_sub import Message
from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.middleware.dead_letter import dead_letter_attributes
from reliable_sub.testing.cleanup import delete_rabbitmq_names
from reliable_sub.testing.services import redis_url
from tests.redis_processes import Child
from tests.test_cli_errors import invoke, one_error_line, one_json_error


@pytest.fixture
def prefix() -> Iterator[str]:
    made = f"cli-fh-{uuid.uuid4().hex[:8]}"
    yield made
    client = Redis.from_url(redis_url())
    keys = list(client.scan_iter(f"*{made}*"))
    if keys:
        client.delete(*keys)
    client.close()


def test_json_is_taken_before_the_subcommand_too(prefix: str) -> None:
    before = invoke("--redis-url", redis_url(), "--redis-prefix", prefix, "--json", "stats",
                    "nothing-here")
    after = invoke("--redis-url", redis_url(), "--redis-prefix", prefix, "stats",
                   "nothing-here", "--json")
    assert one_json_error(before, 4) == one_json_error(after, 4)


def test_a_missing_subscription_names_the_prefix_it_was_looked_up_under(prefix: str) -> None:
    line = one_error_line(invoke("--redis-url", redis_url(), "--redis-prefix", prefix,
                                 "stats", "billing"), 4)
    assert line == (
        "error: subscription 'billing' does not exist; create it with ensure_subscription "
        f"(looked up under --redis-prefix '{prefix}': if the consumers use another prefix, "
        "give theirs, or set RELIABLE_SUB_REDIS_PREFIX)")


def test_ctrl_c_ends_a_watch_with_exit_0(prefix: str, tmp_path: Path) -> None:
    adapter = RedisStreamsAdapter(redis_url(), key_prefix=prefix)
    adapter.ensure_subscription_sync(f"{prefix}-orders", "billing")
    adapter.close_sync()
    script = tmp_path / "cli.py"
    script.write_text("from reliable_sub.cli import main\nmain()\n")
    for args in (["top", "billing", "--interval", "0.2", "--json"],
                 ["stats", "billing", "--watch", "0.2", "--json"]):
        child = Child(script, "--redis-url", redis_url(), "--redis-prefix", prefix, *args)
        try:
            reading = json.loads(child.wait_for_line("{"))
            assert reading["subscription"] == "billing"
            child.process.send_signal(signal.SIGINT)
            assert child.process.wait(30) == 0, child.output
            assert "Aborted" not in child.output and "Traceback" not in child.output
        finally:
            child.kill()


def test_dlq_list_shows_the_first_line_of_a_long_error(prefix: str) -> None:
    """At 80 columns a chained, multi-line error wrapped into ~35 rows per letter."""
    adapter = RedisStreamsAdapter(redis_url(), key_prefix=prefix)
    adapter.ensure_subscription_sync(f"{prefix}-orders-dlq", "orders-dlq-sub")
    original = Message.received("1-0", b"{}", {}, 3, None, None, "billing")
    error = ValueError("no stock for sku-7\n" + "\n".join(f"  detail line {n}" for n in range(40)))
    adapter.publish_sync(f"{prefix}-orders-dlq", b"{}",
                         dead_letter_attributes(original, 3, error))
    adapter.close_sync()
    listed = invoke("--redis-url", redis_url(), "--redis-prefix", prefix, "dlq", "list",
                    "orders-dlq-sub", env={"COLUMNS": "80"})
    assert listed.exit_code == 0, listed.output
    assert "no stock for" in listed.stdout and "(more:" in listed.stdout, listed.stdout
    assert "detail line" not in listed.stdout
    assert len(listed.stdout.splitlines()) <= 12, listed.stdout


def test_stats_with_a_management_api_that_does_not_answer_says_so_and_exits_1() -> None:
    """It printed every column "unknown" and exited 0, the reason only in a log the command
    keeps off stderr."""
    from reliable_sub.adapters.rabbitmq import RabbitMQAdapter
    from reliable_sub.testing.services import free_port, rabbitmq_url

    prefix = f"cli-fh-{uuid.uuid4().hex[:8]}"
    adapter = RabbitMQAdapter(rabbitmq_url(), prefix=prefix)
    adapter.ensure_subscription_sync(f"{prefix}-orders", f"{prefix}-billing")
    try:
        port = free_port()
        result = invoke("--amqp-url", rabbitmq_url(), "--amqp-prefix", prefix,
                        "--amqp-management-url", f"http://guest:guest@127.0.0.1:{port}/",
                        "stats", f"{prefix}-billing")
        assert result.exit_code == 1, (result.stdout, result.stderr)
        assert "unknown" in result.stdout
        [line] = result.stderr.splitlines()
        assert line == (f"error: figures unknown for '{prefix}-billing': the RabbitMQ "
                        f"management API at http://127.0.0.1:{port}/ did not answer "
                        "([Errno 111] Connection refused)")
    finally:
        adapter.close_sync()
        asyncio.run(delete_rabbitmq_names(rabbitmq_url(), prefix,
                                          [f"{prefix}-orders", f"{prefix}-billing"]))
