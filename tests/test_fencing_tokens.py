"""Fencing tokens: unique to a store instance in one process, whatever its owner (the contract
across instances is in the shipped dedup suite, reliable_sub/testing/dedup_owners.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from reliable_sub import ConfigurationError, MemoryDedupStore
from reliable_sub.dedup._store_base import OWNER_LIMIT, TokenSource

WITHIN = 30.0


def test_a_token_is_the_owner_a_random_instance_part_and_a_counter() -> None:
    source = TokenSource("billing")
    first, second = source.next(), source.next()
    assert re.fullmatch(r"billing\.[A-Za-z0-9_-]{11}\.1", first), first
    assert second == first[:-1] + "2"
    assert TokenSource("billing").next() != first, "another instance, another random part"


def test_a_store_without_an_owner_gets_a_short_random_one() -> None:
    store = MemoryDedupStore()
    assert re.fullmatch(r"[A-Za-z0-9_-]{8}", store.owner), store.owner
    assert MemoryDedupStore().owner != store.owner


@pytest.mark.parametrize("owner", ["", "a.b", "a|b", "{a}", "x" * (OWNER_LIMIT + 1)])
def test_owners_that_cannot_prefix_a_token_are_refused(owner: str) -> None:
    with pytest.raises(ConfigurationError, match=r"MemoryDedupStore\.owner must be"):
        MemoryDedupStore(owner=owner)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_makes_tokens_of_its_own() -> None:
    """A store made before a fork (a preloading server's workers): parent and child go on from
    the same counter, and must not make the same token."""
    script = (
        "import os\n"
        "from reliable_sub.dedup._store_base import TokenSource\n"
        "source = TokenSource('svc')\n"
        "source.next()\n"
        "read, write = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.write(write, source.next().encode())\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(source.next(), os.read(read, 200).decode())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=WITHIN)
    assert done.returncode == 0, done.stderr
    parent, child = done.stdout.split()
    assert parent.startswith("svc.") and parent.endswith(".2"), parent
    assert child.startswith("svc.") and child != parent, (parent, child)
