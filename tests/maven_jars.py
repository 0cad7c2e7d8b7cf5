"""The Java servers the tests run (Apache Kafka, ElasticMQ), as jars resolved from Maven Central
once per machine into a cache outside the repository.

Each server has a small pom kept with the tests (``tests/kafka/pom.xml``, ``tests/sqs/pom.xml``)
that names its artifact and pins its version in a ``<NAME.version>`` property; nothing is built
from it. ``mvn dependency:copy-dependencies`` copies the runtime jars (through ``~/.m2``) into
``<cache>/<name>-<version>/``, where ``<cache>`` is ``$RELIABLE_SUB_CACHE``, else
``$XDG_CACHE_HOME/reliable-sub``, else ``~/.cache/reliable-sub``.

A copy is complete when its marker file is there: Maven copies into a temporary sibling, which is
renamed into place, and the marker (the pom's digest: an edited pom resolves again) is written
last. An exclusive ``fcntl`` lock beside it makes concurrent callers (pytest-xdist workers,
``scripts/services.sh up``) wait for one resolution. A cached copy costs a file read.

This module is the one place that resolves: the fixtures call :func:`classpath`, and
``scripts/services.sh up`` runs ``python3 tests/maven_jars.py`` (the standard library only: it
runs before any virtualenv exists) so that CI has every jar before pytest starts.
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

HERE = Path(__file__).resolve().parent
# The servers, by the name of their version property and cache directory.
POMS = {"kafka": HERE / "kafka" / "pom.xml", "elasticmq": HERE / "sqs" / "pom.xml"}
MARKER = ".complete"
# A cold resolution downloads ~40 MB of jars and Maven's plugins: seconds on a good link,
# minutes on a slow one. Past this something hangs (a proxy, a dead mirror).
RESOLVE_TIMEOUT = 600.0
# What mvn printed, kept for the error message of a failed resolution.
ERROR_TAIL = 4000
_MAVEN_NS = {"m": "http://maven.apache.org/POM/4.0.0"}


class JarsUnavailable(RuntimeError):
    """The jars are not in the cache and could not be resolved (no ``mvn``, no network, ...)."""


def cache_root() -> Path:
    """Where the project keeps what it downloads for the tests, outside the repository."""
    explicit = os.environ.get("RELIABLE_SUB_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "reliable-sub"


def version(name: str) -> str:
    """The ``<name.version>`` property of ``name``'s pom: the one place it is pinned."""
    pom = POMS[name]
    found = ElementTree.parse(pom).getroot().find(f"m:properties/m:{name}.version", _MAVEN_NS)
    if found is None or not (found.text or "").strip():
        raise JarsUnavailable(f"{pom} has no <{name}.version> property")
    return (found.text or "").strip()


def directory(name: str) -> Path:
    """The cache directory of ``name``'s jars (complete or not)."""
    return cache_root() / f"{name}-{version(name)}"


def _digest(name: str) -> str:
    return hashlib.sha256(POMS[name].read_bytes()).hexdigest()


def _complete(where: Path, digest: str) -> bool:
    try:
        return (where / MARKER).read_text().strip() == digest
    except OSError:
        return False


def ensure(name: str) -> Path:
    """The directory of ``name``'s jars, resolving them first if this machine has no complete
    copy; :class:`JarsUnavailable`, saying why, when they cannot be had."""
    where, digest = directory(name), _digest(name)
    if _complete(where, digest):  # the usual case: no lock, no subprocess
        return where
    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f"{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        if not _complete(where, digest):  # another caller may have resolved meanwhile
            _resolve(name, where, digest)
    return where


def _resolve(name: str, where: Path, digest: str) -> None:
    pom = POMS[name]
    mvn = shutil.which("mvn")
    if mvn is None:
        raise JarsUnavailable(f"{where} has no complete copy and mvn is not on PATH (Debian "
                              f"package maven) to resolve the jars named in {pom}")
    partial = where.with_name(f"{where.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    command = [mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(pom),
               "dependency:copy-dependencies", "-DincludeScope=runtime",
               f"-DoutputDirectory={partial}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        shutil.rmtree(partial, ignore_errors=True)
        raise JarsUnavailable(f"mvn did not resolve {pom} within {RESOLVE_TIMEOUT:.0f}s"
                              ) from None
    jars = list(partial.glob("*.jar")) if partial.is_dir() else []
    if done.returncode != 0 or not jars:
        shutil.rmtree(partial, ignore_errors=True)
        output = (done.stdout + done.stderr)[-ERROR_TAIL:]
        raise JarsUnavailable(f"mvn could not resolve the jars of {pom} (exit "
                              f"{done.returncode}, {len(jars)} jars copied):\n{output}")
    shutil.rmtree(where, ignore_errors=True)  # an incomplete leftover of an interrupted run
    partial.rename(where)
    (where / MARKER).write_text(digest + "\n")


def classpath(name: str) -> str:
    """A ``java -cp`` value naming every jar of ``name`` (resolving them if needed)."""
    return str(ensure(name) / "*")


def main(arguments: list[str]) -> int:
    """``python3 tests/maven_jars.py [--check] [NAME...]`` (every server by default): resolve
    what is missing and say where each is and how long it took; exit 1 with the reason when one
    cannot be had. With ``--check``: only say whether this machine has them, resolving nothing."""
    check = "--check" in arguments
    names = [a for a in arguments if a != "--check"] or list(POMS)
    failed = 0
    for name in names:
        if check:
            cached = _complete(directory(name), _digest(name))
            print(f"{name} jars: {'cached in' if cached else 'not resolved yet, for'} "
                  f"{directory(name)}")
            failed |= not cached
            continue
        began = time.monotonic()
        try:
            where = ensure(name)
        except JarsUnavailable as error:
            print(f"{name} jars: {error}", file=sys.stderr)
            failed = 1
            continue
        print(f"{name} jars: {where} ({time.monotonic() - began:.1f} s)")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
