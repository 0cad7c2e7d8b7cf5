"""The ``reliable-sub`` command's errors: whatever the user gets wrong (an option's value, a
server that is not there or not what they named, a missing extra, a target that is no
Subscriber) is one ``error:`` line on stderr (a JSON object with ``--json``) and an exit code
the README documents, never a traceback; and the command reaches NATS (``--nats-url``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner, Result
from redis import Redis
from sqlalchemy.engine import make_url

from reliable_sub import Message
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter
from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.cli import brokers, connect
from reliable_sub.cli.app import cli
from reliable_sub.cli.brokers import Broker
from reliable_sub.cli.connect import Connection
from reliable_sub.middleware.dead_letter import dead_letter_attributes
from reliable_sub.testing.harness import delete_nats_streams
from reliable_sub.testing.services import emulator_host, postgres_url, rabbitmq_url, redis_url
from tests.nats_processes import NatsServer

SCRIPT = Path(sys.executable).with_name("reliable-sub")
# generous: the command waits --connect-timeout (1 s here) and closes its clients
UNREACHABLE_WITHIN = 30.0


def clean_environment() -> dict[str, str]:
    """This process's environment without the command's variables (the test services read
    RELIABLE_SUB_REDIS_URL too: a broker named there would be a second broker)."""
    return {name: value for name, value in os.environ.items()
            if not name.startswith("RELIABLE_SUB_")}


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    unset: dict[str, str | None] = {name: None for name in os.environ
                                    if name.startswith("RELIABLE_SUB_")}
    return CliRunner().invoke(cli, list(args), env={**unset, **(env or {})},
                              prog_name="reliable-sub")


def one_error_line(result: Result, code: int) -> str:
    """The error line of a command that ended with ``code`` and printed nothing else."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr,
                                      result.exception)
    assert isinstance(result.exception, SystemExit), "an exit, not an exception"
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: "), line
    return line


def one_json_error(result: Result, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    error = json.loads(line)
    assert error["exit_code"] == code and set(error) == {"error", "exit_code"}
    text: str = error["error"]
    return text


def free_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that takes connections into its backlog and never answers: a server
    that hangs instead of refusing (a stopped process, a firewall dropping packets)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        yield server.getsockname()[1]


# -- the values of options ------------------------------------------------------------------

BAD_VALUES = [
    (["--redis-url", "http://localhost:6379", "stats", "s"],
     ["--redis-url 'http://localhost:6379'", "redis://", "redis+cluster://"]),
    (["--redis-url", "redis://127.0.0.1:99999/0", "stats", "s"], ["port '99999'", "1 to 65535"]),
    (["--redis-url", "redis://127.0.0.1:six/0", "stats", "s"], ["port 'six'"]),
    (["--nats-url", "http://127.0.0.1:4222", "stats", "s"], ["--nats-url", "nats://"]),
    (["--nats-url", "nats://127.0.0.1:4222,nats://127.0.0.1:0", "stats", "s"], ["port '0'"]),
    (["--pubsub-project", "abc", "stats", "s"], ["--pubsub-project 'abc'", "6+ characters"]),
    (["--amqp-url", "amqp://guest:guest@127.0.0.1:5672/", "--amqp-management-url",
      "ftp://127.0.0.1:15672/", "stats", "s"],
     ["--amqp-management-url 'ftp://127.0.0.1:15672/'", "http://"]),
    (["--redis-url", "redis://127.0.0.1:6379/0", "--amqp-management-url",
      "http://127.0.0.1:15672/", "stats", "s"],
     ["--amqp-management-url is an option of --amqp-url", "the broker named is --redis-url"]),
    (["--database-url", "oracle://scott@127.0.0.1/test", "outbox", "status"],
     ["--database-url 'oracle://scott@127.0.0.1/test'",
      "postgresql, mariadb (mysql://) and sqlite"]),
    (["--database-url", "nonsense", "outbox", "status"], ["no scheme", "postgresql://"]),
    (["--database-url", "postgresql://127.0.0.1:70000/test", "outbox", "status"],
     ["port '70000'"]),
    (["--redis-url", "redis://127.0.0.1:6379/0", "--dedup-url", "http://x", "seek", "s",
      "--to", "-1h", "--mode", "reprocess"], ["--dedup-url 'http://x'", "redis://"]),
    (["--redis-url", "redis://127.0.0.1:6379/0", "--nats-url", "nats://127.0.0.1:4222",
      "stats", "s"], ["exactly one broker", "got --redis-url, --nats-url"]),
    (["stats", "s"], ["exactly one broker", "--nats-url (RELIABLE_SUB_NATS_URL)"]),
    (["--redis-url", "redis://127.0.0.1:6379/0", "stats"], ["Missing argument"]),
    (["--no-such-option", "stats", "s"], ["No such option"]),
    (["--connect-timeout", "0", "--redis-url", "redis://127.0.0.1:6379/0", "stats", "s"],
     ["--connect-timeout"]),
    (["--connect-timeout", "nan", "--redis-url", "redis://127.0.0.1:6379/0", "stats", "s"],
     ["--connect-timeout", "finite number of seconds, more than 0"]),
    (["--redis-url", "redis://127.0.0.1:6379/0", "dlq", "list", "s", "--wait", "inf"],
     ["--wait", "finite number of seconds, 0 or more"]),
    (["--database-url", "sqlite://", "outbox", "purge", "--older-than", "nan", "--yes"],
     ["--older-than", "finite number of seconds"]),
    (["--redis-url", "redis://127.0.0.1:6379/0", "seek", "s", "--to", "-99999999d"],
     ["'-99999999d' reaches back before the year 1"]),
]


@pytest.mark.parametrize(("args", "said"), BAD_VALUES)
def test_a_bad_option_value_is_one_error_line_and_exit_2(args: list[str],
                                                         said: list[str]) -> None:
    line = one_error_line(invoke(*args), 2)
    for words in said:
        assert words in line


def test_a_group_without_its_command_shows_its_help() -> None:
    for args in ([], ["dlq"]):
        shown = invoke(*args)
        output = shown.stdout + shown.stderr
        assert isinstance(shown.exception, SystemExit) or shown.exception is None
        assert "Commands:" in output and "error:" not in output, output


def test_with_json_the_error_is_one_json_object_on_stderr() -> None:
    text = one_json_error(invoke("--pubsub-project", "abc", "stats", "s", "--json"), 2)
    assert "6+ characters" in text
    text = one_json_error(invoke("--redis-url", "redis://127.0.0.1:6379/0", "stats", "--json"),
                          2)
    assert "Missing argument 'SUBSCRIPTION...'" in text, "a usage error of click's too"
    port = free_port()
    text = one_json_error(invoke("--redis-url", f"redis://127.0.0.1:{port}/0", "dlq", "list",
                                 "s", "--json"), 3)
    assert "cannot reach" in text


def test_a_password_in_a_url_is_not_shown() -> None:
    line = one_error_line(invoke("--redis-url", "redis://ops:s3cret@127.0.0.1:99999/0",
                                 "stats", "s"), 2)
    assert "s3cret" not in line and "redis://ops:***@127.0.0.1:99999/0" in line


def test_a_missing_extra_names_the_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nats", None)  # as if nats-py were not installed
    monkeypatch.delitem(sys.modules, "reliable_sub.adapters.nats_jetstream")
    line = one_error_line(invoke("--nats-url", "nats://127.0.0.1:4222", "stats", "s"), 2)
    assert 'pip install "reliable-sub[nats]"' in line, "the extra's name, not eaten as markup"


# -- servers that are not there, or not what was named --------------------------------------

def test_a_server_that_hangs_is_unreachable_after_the_connect_timeout(
    silent_port: int,
) -> None:
    for args in (["--redis-url", f"redis://127.0.0.1:{silent_port}/0", "stats", "s"],
                 ["--database-url", f"postgresql://127.0.0.1:{silent_port}/test",
                  "outbox", "status"],
                 ["--redis-url", redis_url(), "--dedup-url",
                  f"postgresql://127.0.0.1:{silent_port}/test", "seek", "s", "--to", "-1h",
                  "--mode", "reprocess"]):
        started = time.monotonic()
        line = one_error_line(invoke("--connect-timeout", "1", *args), 3)
        assert time.monotonic() - started < UNREACHABLE_WITHIN
        assert "did not answer within 1 s" in line and str(silent_port) in line


def test_pubsub_off_its_endpoint_is_unreachable_at_once(silent_port: int) -> None:
    """The emulator's host refusing, or silent: exit 3 after the connect timeout, not after
    the minute the Google client retries for."""
    for host in (f"127.0.0.1:{free_port()}", f"127.0.0.1:{silent_port}"):
        started = time.monotonic()
        line = one_error_line(invoke("--connect-timeout", "1", "--pubsub-project",
                                     "reliable-sub-cli", "stats", "s",
                                     env={"PUBSUB_EMULATOR_HOST": host}), 3)
        assert time.monotonic() - started < UNREACHABLE_WITHIN
        assert "--pubsub-project 'reliable-sub-cli'" in line


def test_a_name_pubsub_does_not_take_is_a_usage_error() -> None:
    env = {"PUBSUB_EMULATOR_HOST": emulator_host()}
    for args in (["stats", "bad name!"], ["dlq", "list", "goog-queue", "--wait", "0.5"],
                 ["snapshot", "delete", "bad name!"]):
        line = one_error_line(invoke("--pubsub-project", "reliable-sub-cli", *args, env=env), 2)
        assert "refused the request as invalid (InvalidArgument: 400 Invalid" in line


def test_pubsub_without_credentials_says_so(tmp_path: Path) -> None:
    line = one_error_line(invoke("--pubsub-project", "reliable-sub-cli", "stats", "s", env={
        "PUBSUB_EMULATOR_HOST": "",
        "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "no-such-key.json")}), 2)
    assert "no Google Cloud credentials" in line and "PUBSUB_EMULATOR_HOST" in line


def test_a_server_that_answers_and_refuses_is_a_configuration_error(
    nats_server: NatsServer,
) -> None:
    redis, database = urlsplit(redis_url()), make_url(postgres_url())
    nats_port = urlsplit(nats_server.url).port
    no_database = database.set(database=f"no_such_database_{uuid.uuid4().hex[:6]}")
    cases = [
        (["--redis-url", f"redis://127.0.0.1:{nats_port}/0", "stats", "s"],
         "did not answer as Redis does"),
        (["--redis-url", f"redis://{redis.netloc}/999", "stats", "s"],
         "DB index is out of range"),
        (["--redis-url", f"redis://nobody:wrong@{redis.hostname}:{redis.port}/0", "stats",
          "s"], "refused the credentials"),
        (["--database-url", no_database.render_as_string(hide_password=False), "outbox",
          "status"], "does not exist"),
        (["--database-url", f"postgresql://127.0.0.1:{nats_port}/test", "outbox", "status"],
         "the database refused the connection"),
    ]
    for args, said in cases:
        assert said in one_error_line(invoke(*args), 2)


# -- run MODULE:ATTRIBUTE ---------------------------------------------------------------------

@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's project: ``run`` imports its modules from the working directory."""
    (tmp_path / "cli_factories.py").write_text(
        "def needs(broker):\n    return broker\n\n"
        "def number():\n    return 3\n\n"
        "async def later():\n    return None\n")
    (tmp_path / "cli_bad_policy.py").write_text(
        "from reliable_sub import RetryPolicy\npolicy = RetryPolicy(min_backoff=-1)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return tmp_path


RUN_TARGETS = [
    ("json:dumps", "a callable that needs arguments (obj)"),
    ("json", "expected MODULE:ATTRIBUTE"),
    ("json:nothing", "'json' has no attribute 'nothing'"),
    ("os:sep", "a value of type str"),
    ("builtins:print", "builtin_function_or_method"),  # not called: it is no factory
    ("json:JSONDecoder", "the class JSONDecoder"),
    ("no_such_module_here:sub", "cannot import 'no_such_module_here'"),
    ("cli_factories.py:sub", "name a module"),
    ("cli_factories:needs", "needs arguments (broker)"),
    ("cli_factories:number", "returned a value of type int"),
    ("cli_factories:later", "an async function"),
    ("cli_bad_policy:policy", "importing 'cli_bad_policy': RetryPolicy.min_backoff"),
]


@pytest.mark.parametrize(("target", "said"), RUN_TARGETS)
def test_run_names_what_is_wrong_with_its_target(project: Path, target: str,
                                                 said: str) -> None:
    line = one_error_line(invoke("run", target), 2)
    assert said in line


# -- as users run it: a process ---------------------------------------------------------------

def reliable_sub(*args: str, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "reliable_sub.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60,
                          check=False, cwd=cwd,
                          env={**clean_environment(), "COLUMNS": "80", **(env or {})})


@pytest.mark.parametrize("how", ["entry point", "python -m"])
def test_a_process_prints_one_line_and_no_traceback(how: str, tmp_path: Path,
                                                    silent_port: int) -> None:
    command = ([str(SCRIPT)] if how == "entry point" else
               [sys.executable, "-m", "reliable_sub.cli"])
    if how == "entry point" and not SCRIPT.exists():
        pytest.skip("no console script next to this interpreter")
    cases = [
        (["--redis-url", "http://localhost:6379", "stats", "s"], 2),
        (["--pubsub-project", "abc", "stats", "s"], 2),
        (["--database-url", "oracle://scott@127.0.0.1/test", "outbox", "status"], 2),
        (["run", "json:dumps"], 2),
        (["--connect-timeout", "1", "--redis-url", f"redis://127.0.0.1:{silent_port}/0",
          "stats", "s"], 3),
        # the NATS adapter logs its failed connection attempts: not on the command's stderr
        (["--connect-timeout", "2", "--nats-url", f"nats://127.0.0.1:{free_port()}", "stats",
          "s"], 3),
    ]
    for args, code in cases:
        done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=60,
                              check=False, cwd=tmp_path,
                              env={**clean_environment(), "COLUMNS": "80"})
        assert done.returncode == code, (args, done.stderr)
        assert "Traceback" not in done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, done.stderr)


def test_without_the_cli_extra_the_command_says_what_to_install(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['click'] = None; "
         "from reliable_sub.cli import main; main()", "stats", "s"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
        env=clean_environment())
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("error: reliable-sub needs the cli extra (")
    assert line.endswith('; run: pip install "reliable-sub[cli]"')


def test_names_and_errors_from_the_broker_are_printed_as_they_are() -> None:
    """Rich reads ``[...]`` as markup: a dead letter's error or a message id such as ``[/x]``
    was dropped from the output, or ended the command with a MarkupError traceback."""
    url, prefix = redis_url(), f"cli-{uuid.uuid4().hex[:10]}"
    adapter = RedisStreamsAdapter(url, key_prefix=prefix)
    queue = f"{prefix}-dlq-ops"
    try:
        adapter.ensure_subscription_sync(f"{prefix}-dlq", queue)
        original = Message(id="1-0", data=b"x", attributes={}, subscription="[bold]billing")
        adapter.publish_sync(f"{prefix}-dlq", b"x", dead_letter_attributes(
            original, 3, ValueError("[/x] bad [bold]input")))
        args = ["--redis-url", url, "--redis-prefix", prefix, "dlq"]
        listed = invoke(*args, "list", queue, "--wait", "0.2", env={"COLUMNS": "200"})
        assert listed.exit_code == 0, listed.stderr
        assert "[bold]billing" in listed.stdout
        assert "builtins.ValueError: [/x] bad [bold]input" in listed.stdout
        missing = invoke(*args, "replay", queue, "[/x]", "--wait", "0.2")
        assert missing.exit_code == 1, (missing.stderr, missing.exception)
        assert missing.stderr.splitlines() == ["not in the queue: [/x]"]
    finally:
        adapter.close_sync()
        client = Redis.from_url(url)
        keys = list(client.scan_iter(f"*{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


# -- NATS --------------------------------------------------------------------------------------

class NatsWorld:
    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = f"cli{uuid.uuid4().hex[:10]}"
        self.topic, self.sub = f"{self.prefix}-orders", f"{self.prefix}-billing"
        self.dlq_topic, self.dlq = f"{self.prefix}-orders-dlq", f"{self.prefix}-dlq-ops"
        self.adapter = NatsJetStreamAdapter(url, prefix=self.prefix)

    def args(self, *args: str) -> list[str]:
        return ["--nats-url", self.url, "--nats-prefix", self.prefix, *args]


@pytest.fixture
async def nats_world(nats_server: NatsServer) -> AsyncIterator[NatsWorld]:
    world = NatsWorld(nats_server.url)
    await world.adapter.ensure_subscription(world.topic, world.sub, ack_deadline=30.0)
    await world.adapter.ensure_subscription(world.dlq_topic, world.dlq, ack_deadline=30.0)
    yield world
    await world.adapter.close()
    await delete_nats_streams(world.url, world.prefix)


def as_json(done: subprocess.CompletedProcess[str]) -> object:
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


async def test_the_command_reaches_nats(nats_world: NatsWorld) -> None:
    world = nats_world
    original = Message(id="7", data=b"order-7", attributes={}, subscription=world.sub)
    letter = await world.adapter.publish(world.dlq_topic, b"order-7",
                                         dead_letter_attributes(original, 3, KeyError("sku")))

    listed = as_json(reliable_sub(*world.args("dlq", "list", world.dlq, "--json",
                                              "--wait", "0.5")))
    assert isinstance(listed, list)
    assert [(item["id"], item["error_type"]) for item in listed] == [
        (letter, "builtins.KeyError")]
    figures = as_json(reliable_sub(*world.args("stats", world.sub, "--json",
                                               "--dead-letter-subscription", world.dlq)))
    assert figures == {"subscription": world.sub, "backlog": 0, "in_flight": 0,
                       "oldest_unacked_age_seconds": None, "ack_deadline_seconds": 30.0,
                       "dead_lettered_waiting": 1}
    replayed = as_json(reliable_sub(*world.args("dlq", "replay", world.dlq, "--json",
                                                "--wait", "0.5")))
    assert replayed == {"replayed": [letter], "failed": {}, "missing": []}
    [back] = await world.adapter.receive(world.sub, 10, 5.0)
    assert back.message.data == b"order-7"
    assert back.message.attributes["idempotency-key"] == "7"
    await world.adapter.ack([back])

    no_seek = reliable_sub(*world.args("snapshot", "list"))
    assert no_seek.returncode == 2
    assert no_seek.stderr.splitlines() == ["error: NatsJetStreamAdapter cannot seek or keep "
                                           "snapshots"]
    unknown = reliable_sub(*world.args("stats", f"{world.prefix}-nothing"))
    assert unknown.returncode == 4 and "does not exist" in unknown.stderr


def test_a_cluster_dedup_url_is_a_redis_store() -> None:
    from reliable_sub.dedup import RedisDedupStore

    connection = Connection(dedup_url="redis+cluster://127.0.0.1:7000,127.0.0.1:7001/0")
    assert isinstance(connection.dedup_store(), RedisDedupStore)


# -- another adapter is one entry ---------------------------------------------------------------

async def test_another_broker_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = MemoryAdapter()
    entry = Broker("--memory-url", "A broker in this process.",
                   lambda url, prefix: memory, schemes=("memory",))
    monkeypatch.setattr(connect, "BROKERS", (*brokers.BROKERS, entry))
    connection = Connection.from_options({
        "redis_url": None, "redis_prefix": "reliable-sub", "nats_url": None,
        "nats_prefix": "reliable-sub", "amqp_url": None, "amqp_prefix": "reliable-sub",
        "kafka_bootstrap": None, "kafka_prefix": "reliable-sub",
        "sqs_endpoint": None, "sqs_queue_prefix": "", "sqs_region": None,
        "pubsub_project": None, "memory_url": "memory://here"})
    assert connection.adapter() is memory
    await connection.reach_adapter(memory)
    assert (entry.param, entry.envvar) == ("memory_url", "RELIABLE_SUB_MEMORY_URL")
    wrong = Connection.from_options({
        "redis_url": None, "redis_prefix": "reliable-sub", "nats_url": None,
        "nats_prefix": "reliable-sub", "amqp_url": None, "amqp_prefix": "reliable-sub",
        "kafka_bootstrap": None, "kafka_prefix": "reliable-sub",
        "sqs_endpoint": None, "sqs_queue_prefix": "", "sqs_region": None,
        "pubsub_project": None, "memory_url": "http://x"})
    with pytest.raises(ValueError, match="--memory-url 'http://x'"):
        wrong.adapter()



# -- the first hour's errors (#47): one line naming the fix, the documented exit code ----------

def _amqp(netloc: str, path: str = "/") -> str:
    amqp = urlsplit(rabbitmq_url())
    return f"amqp://{netloc or amqp.netloc}{path}"


def test_each_server_error_is_one_line_naming_the_fix_with_its_documented_code(
        tmp_path: Path) -> None:
    """Run as a process, so a client's own log lines would show on stderr: a wrong vhost gave
    a 124-line traceback (rc 1), refused credentials "cannot reach ... ACCESS_REFUSED" (rc 3), a
    refused AMQP port aiormq's "error when creating transport" line before ours, an AMQP URL
    pointed at Redis "did not answer within 10 s" after 5.5 s, a Redis URL pointed at
    PostgreSQL "Connection closed by server." (rc 3), a refused NATS port "TimeoutError()"."""
    amqp = urlsplit(rabbitmq_url())
    credentials = f"{amqp.username}:{amqp.password}"
    redis_port = urlsplit(redis_url()).port
    postgres_port = make_url(postgres_url()).port or 5432
    closed = free_port()
    cases = [
        (["--amqp-url", _amqp("", "/no-such-vhost")], 2,
         "refused virtual host 'no-such-vhost': it does not exist, or user "
         f"'{amqp.username}' may not use it"),
        (["--amqp-url", _amqp(f"{amqp.username}:wrong@{amqp.hostname}:{amqp.port}")], 2,
         f"refused the credentials of user '{amqp.username}'"),
        (["--amqp-url", _amqp(f"{credentials}@127.0.0.1:{closed}")], 3,
         f"RabbitMQ at 127.0.0.1:{closed} refused the connection"),
        (["--amqp-url", _amqp(f"{credentials}@127.0.0.1:{redis_port}")], 3,
         f"RabbitMQ at 127.0.0.1:{redis_port} did not complete the AMQP handshake within 5s"),
        (["--redis-url", f"redis://127.0.0.1:{postgres_port}/0"], 2,
         "the server did not answer as Redis does"),
        (["--nats-url", f"nats://127.0.0.1:{closed}"], 3, "Connect call failed"),
    ]
    for args, code, said in cases:
        done = subprocess.run([sys.executable, "-m", "reliable_sub.cli", *args, "stats", "s"],
                              capture_output=True, text=True, timeout=60, check=False,
                              cwd=tmp_path, env={**clean_environment(), "COLUMNS": "80"})
        lines = done.stderr.splitlines()
        assert (done.returncode, len(lines)) == (code, 1), (args, done.stderr)
        assert lines[0].startswith("error: ") and said in lines[0], (args, lines[0])
