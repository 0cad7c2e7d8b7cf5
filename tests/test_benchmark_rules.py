"""The benchmarks' stage rules name functions that exist: a rename must not silently move time
from one stage to another in the published profiles."""

from __future__ import annotations

import importlib

import pytest

from benchmarks._common import rule, unknown_rule_names


@pytest.mark.parametrize("name", ["memory_pipeline", "redis_streams", "pubsub"])
def test_every_stage_rule_names_a_function_its_file_defines(name: str) -> None:
    if name == "redis_streams":
        pytest.importorskip("faststream", reason='the Redis benchmark needs "reliable-sub[bench]"')
    module = importlib.import_module(f"benchmarks.{name}")
    assert unknown_rule_names(module.STAGE_RULES) == []


def test_a_renamed_function_is_reported() -> None:
    rules = [rule("x", "reliable_sub/_runtime/receiver.py", "_admit", "_no_such_function"),
             rule("x", "reliable_sub/moved_away.py")]
    assert unknown_rule_names(rules) == ["reliable_sub/_runtime/receiver.py: _no_such_function",
                                         "reliable_sub/moved_away.py: no such file"]
