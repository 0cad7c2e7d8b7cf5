"""ElasticMQ's jars, resolved from Maven Central once per machine, into a cache outside the repo.

The one place that knows how: ``tests/sqs_processes.py`` calls :func:`elasticmq_classpath` before
it starts a server, and ``scripts/services.sh up`` runs this file (``python3 tests/sqs_jars.py``,
the standard library only: it runs before any virtualenv exists) so that CI has the jars before
pytest. The artifact and its version are those of ``tests/sqs/pom.xml``; Maven resolves their
runtime dependencies (``mvn dependency:copy-dependencies``) into

    ${RELIABLE_SUB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/reliable-sub}/elasticmq-<version>/

A directory is complete once its marker file is there: the jars are copied into a temporary
sibling first, which is renamed into place and marked only after Maven succeeded. An exclusive
``fcntl`` lock beside it makes concurrent callers (pytest-xdist workers, a script) wait for one
resolution instead of running several. A cached directory costs one ``stat``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from pathlib import Path

POM = Path(__file__).resolve().parent / "sqs" / "pom.xml"
_MAVEN_NS = {"m": "http://maven.apache.org/POM/4.0.0"}
# Written last, into a directory whose every jar was copied: its presence means "complete".
MARKER = ".complete"
# A cold resolution downloads ~40 jars (37 MB) and Maven's plugins: ~10 s on a good link. This
# bounds a stalled download, not a slow one.
RESOLVE_TIMEOUT = 600.0
# The class every ElasticMQ server release starts from (its jar's Main-Class).
MAIN_CLASS = "org.elasticmq.server.Main"


class JarsUnavailable(RuntimeError):
    """ElasticMQ's jars are not cached and could not be resolved (no Maven, no network)."""


def cache_root() -> Path:
    """Where the project caches what it downloads for tests: ``RELIABLE_SUB_CACHE``, else
    ``$XDG_CACHE_HOME/reliable-sub``, else ``~/.cache/reliable-sub``."""
    explicit = os.environ.get("RELIABLE_SUB_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "reliable-sub"


def elasticmq_version(pom: Path = POM) -> str:
    """The ``elasticmq.version`` property of the tests' pom."""
    version = ElementTree.parse(pom).find("m:properties/m:elasticmq.version", _MAVEN_NS)
    if version is None or not (version.text or "").strip():
        raise JarsUnavailable(f"{pom} names no elasticmq.version property")
    return (version.text or "").strip()


def elasticmq_directory() -> Path:
    """The cache directory of the pom's ElasticMQ version (complete or not)."""
    return cache_root() / f"elasticmq-{elasticmq_version()}"


def elasticmq_classpath() -> str:
    """A ``java -cp`` value for the cached jars, resolving them first if needed."""
    return str(ensure_elasticmq_jars() / "*")


def ensure_elasticmq_jars() -> Path:
    """The directory of ElasticMQ's jars, resolved by Maven now if it is not complete yet."""
    directory = elasticmq_directory()
    if (directory / MARKER).exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(directory.with_name(directory.name + ".lock")):
        if not (directory / MARKER).exists():  # another process may have finished meanwhile
            _resolve(directory)
    return directory


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process resolves
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _resolve(directory: Path) -> None:
    maven = shutil.which("mvn")
    if maven is None:
        raise JarsUnavailable(f"ElasticMQ's jars are not in {directory} and mvn is not on PATH "
                              "(Debian package maven) to resolve them")
    partial = directory.with_name(directory.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    command = [
        maven, "--batch-mode", "--quiet", "--file", str(POM),
        "dependency:copy-dependencies", "-DincludeScope=runtime",
        f"-DoutputDirectory={partial}",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise JarsUnavailable(f"mvn did not resolve ElasticMQ within {RESOLVE_TIMEOUT:g}s"
                              ) from error
    jars = sorted(partial.glob("*.jar")) if partial.is_dir() else []
    if done.returncode != 0 or not any(j.name.startswith("elasticmq-server") for j in jars):
        shutil.rmtree(partial, ignore_errors=True)
        tail = (done.stdout + done.stderr)[-3000:]
        raise JarsUnavailable(f"mvn could not resolve ElasticMQ {elasticmq_version()} "
                              f"(exit {done.returncode}): {' '.join(command)}\n{tail}")
    shutil.rmtree(directory, ignore_errors=True)  # an incomplete leftover of a killed run
    partial.rename(directory)
    (directory / MARKER).write_text("".join(f"{jar.name}\n" for jar in jars))


def main() -> int:
    """Resolve the jars if they are missing; print their directory. Exit 1 with the reason."""
    try:
        print(ensure_elasticmq_jars())
    except JarsUnavailable as error:
        print(f"elasticmq: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
