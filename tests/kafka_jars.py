"""The Apache Kafka jars the tests' brokers run, resolved once per machine into a cache.

``tests/kafka/pom.xml`` names them; ``mvn dependency:copy-dependencies`` copies them (from Maven
Central, through ``~/.m2``) into ``<cache>/kafka-<version>/``, where ``<cache>`` is
``$RELIABLE_SUB_CACHE``, else ``$XDG_CACHE_HOME/reliable-sub``, else ``~/.cache/reliable-sub``:
outside the repository, kept between runs, so a run resolves nothing once the machine has them.

A copy is complete when its marker file is there, written last and holding the pom's digest (an
edited pom resolves again). An exclusive lock on ``kafka-<version>.lock`` beside it makes
concurrent callers (pytest-xdist workers, ``scripts/services.sh up``) resolve one at a time: the
first copies, the others find the marker and return.

This one module is the only place that resolves: the test fixtures call :func:`kafka_classpath`,
and ``scripts/services.sh up`` runs ``python3 tests/kafka_jars.py`` (standard library only, so it
runs before any virtualenv exists).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

POM = Path(__file__).resolve().parent / "kafka" / "pom.xml"
MARKER = ".complete"
# A cold resolution downloads ~45 MB of jars and Maven's plugins; a few seconds on a good link,
# minutes on a slow one. Past this something hangs (a proxy, a dead mirror).
RESOLVE_TIMEOUT = 600.0
# What mvn printed, kept for the error message of a failed resolution.
ERROR_TAIL = 4000


class KafkaJarsUnavailable(RuntimeError):
    """The jars are not in the cache and could not be resolved (no ``mvn``, no network, ...)."""


def kafka_version(pom: Path = POM) -> str:
    """The ``kafka.version`` property of the pom: the single place the version is pinned."""
    namespace = {"m": "http://maven.apache.org/POM/4.0.0"}
    found = ElementTree.parse(pom).getroot().find("m:properties/m:kafka.version", namespace)
    if found is None or not (found.text or "").strip():
        raise KafkaJarsUnavailable(f"{pom} has no <kafka.version> property")
    return (found.text or "").strip()


def cache_root() -> Path:
    """Where the project keeps what it downloads for the tests, outside the repository."""
    explicit = os.environ.get("RELIABLE_SUB_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "reliable-sub"


def jars_directory(pom: Path = POM) -> Path:
    return cache_root() / f"kafka-{kafka_version(pom)}"


def _digest(pom: Path) -> str:
    return hashlib.sha256(pom.read_bytes()).hexdigest()


def _complete(directory: Path, digest: str) -> bool:
    try:
        return (directory / MARKER).read_text().strip() == digest
    except OSError:
        return False


def ensure_jars(pom: Path = POM) -> Path:
    """The directory of the jars, resolving them first if this machine has no complete copy.

    Raises :class:`KafkaJarsUnavailable` saying why when they cannot be had.
    """
    directory = jars_directory(pom)
    digest = _digest(pom)
    if _complete(directory, digest):  # the usual case: no lock, no subprocess
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        if not _complete(directory, digest):  # another caller may have resolved meanwhile
            _resolve(pom, directory, digest)
    return directory


def _resolve(pom: Path, directory: Path, digest: str) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaJarsUnavailable("mvn is not on PATH (Debian package maven): it resolves the "
                                   f"Kafka broker's jars named in {pom}")
    shutil.rmtree(directory, ignore_errors=True)  # a copy without its marker was interrupted
    command = [mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(pom),
               "dependency:copy-dependencies", "-DincludeScope=runtime",
               f"-DoutputDirectory={directory}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise KafkaJarsUnavailable(f"mvn did not resolve {pom} within {RESOLVE_TIMEOUT:.0f}s"
                                   ) from None
    jars = list(directory.glob("*.jar"))
    if done.returncode != 0 or not jars:
        output = (done.stdout + done.stderr)[-ERROR_TAIL:]
        raise KafkaJarsUnavailable(f"mvn could not resolve the Kafka jars of {pom} (exit "
                                   f"{done.returncode}, {len(jars)} jars copied):\n{output}")
    (directory / MARKER).write_text(digest + "\n")


def kafka_classpath(pom: Path = POM) -> str:
    """A ``java -cp`` value naming every jar of the broker (resolving them if needed)."""
    return str(ensure_jars(pom) / "*")


def main(arguments: list[str]) -> int:
    """``python3 tests/kafka_jars.py``: resolve if needed, say where the jars are and how long
    it took; exit 1 with the reason when they cannot be had. With ``--check``: only say
    whether this machine has them (exit 1 if not), resolving nothing."""
    if arguments == ["--check"]:
        directory = jars_directory()
        cached = _complete(directory, _digest(POM))
        print(f"kafka jars: {'cached in' if cached else 'not resolved yet, for'} {directory}")
        return 0 if cached else 1
    began = time.monotonic()
    try:
        directory = ensure_jars()
    except KafkaJarsUnavailable as error:
        print(f"kafka jars: {error}", file=sys.stderr)
        return 1
    print(f"kafka jars: {directory} ({time.monotonic() - began:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
