"""The benchmarks' stage rules name functions that exist: a rename must not silently move time
from one stage to another in the published profiles. Their report templates get exactly the
fields they use."""

from __future__ import annotations

import ast
import importlib
import re
import string

import pytest

from benchmarks._common import rule, unknown_rule_names
from benchmarks._harness import TEMPLATES


@pytest.mark.parametrize("name", ["memory_pipeline", "redis_streams", "pubsub", "sqs"])
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


def _render_calls() -> list[tuple[str, str, set[str]]]:
    """``(file, template, keywords)`` of every ``render("template", ...)`` call in benchmarks/."""
    calls = []
    for path in sorted(TEMPLATES.parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "render" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                keywords = {keyword.arg for keyword in node.keywords if keyword.arg}
                calls.append((path.name, node.args[0].value, keywords))
    return calls


def test_every_report_template_gets_exactly_its_fields() -> None:
    """A README section's prose is a template: a field the code does not pass would fail only
    when the benchmark runs (rarely, and at its end); a value passed but never used is stale."""
    calls = _render_calls()
    assert calls
    used_templates = set()
    for filename, template, keywords in calls:
        text = (TEMPLATES / f"{template}.md").read_text()
        fields = {re.split(r"[.\[]", name, maxsplit=1)[0]
                  for _, name, _, _ in string.Formatter().parse(text) if name}
        assert fields == keywords, (filename, template, fields ^ keywords)
        used_templates.add(template)
    assert {path.stem for path in TEMPLATES.glob("*.md")} == used_templates
