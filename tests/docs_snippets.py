"""How the Python snippets of README.md and docs/ are run by the test suite (Sybil).

Each Markdown file is one namespace: its snippets run in order, each as one test, so a later
snippet uses what an earlier one made. A snippet may ``await`` at the top level (as in an asyncio
REPL); those run on one event loop per file, closed when the file is done. Two HTML comments,
invisible on the page, steer a file:

* ``<!-- invisible-code-block: python ... -->`` runs code the reader does not need to see (a
  unique topic name, a table to write to, a check of what a snippet did);
* ``<!-- skip: next "partial: <why>" -->`` marks the next snippet as deliberately partial; it is
  reported as skipped with that reason. Everything else runs.

Code registered with ``cleanup(fn)`` (a name every file's namespace has) runs when the file is
done, also when a snippet failed: services the snippets start are stopped there.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sybil import Example, Sybil
from sybil.evaluators.python import pad
from sybil.parsers.markdown import CodeBlockParser, SkipParser

_LOOP = "_docs_loop"
_CLEANUPS = "_docs_cleanups"


def _evaluate(example: Example) -> None:
    """Run one snippet; a snippet with a top-level ``await`` runs on the file's event loop."""
    __tracebackhide__ = True
    source = pad(example.parsed, example.line + example.parsed.line_offset)
    code = compile(source, example.path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                   dont_inherit=True)
    namespace = example.namespace
    # as in a module of the reader's own: functions get a __module__ (@idempotent's namespace)
    namespace.setdefault("__name__", _module_name(Path(example.path)))
    result = eval(code, namespace)
    if code.co_flags & inspect.CO_COROUTINE:
        _loop_of(namespace).run_until_complete(result)
    namespace.pop("__builtins__", None)


def _loop_of(namespace: dict[str, Any]) -> asyncio.AbstractEventLoop:
    """The file's event loop, made on first use."""
    loop: asyncio.AbstractEventLoop | None = namespace.get(_LOOP)
    if loop is None:
        loop = namespace[_LOOP] = asyncio.new_event_loop()
    return loop


def _module_name(path: Path) -> str:
    """``docs/concepts/idempotency-keys.md`` -> ``docs.concepts.idempotency_keys``."""
    parts = path.with_suffix("").parts[-3:]
    return ".".join(re.sub(r"\W", "_", part) for part in parts)


def _setup(namespace: dict[str, Any]) -> None:
    cleanups: list[Callable[[], Any]] = []
    namespace[_CLEANUPS] = cleanups
    namespace["cleanup"] = cleanups.append


def _teardown(namespace: dict[str, Any]) -> None:
    """Run every cleanup, newest first, even after one failed (the first failure is raised at
    the end: a service started earlier is still stopped), then close the file's loop."""
    failure: BaseException | None = None
    for fn in reversed(namespace[_CLEANUPS]):
        try:
            outcome = fn()
            if inspect.isawaitable(outcome):
                _loop_of(namespace).run_until_complete(outcome)
        except Exception as error:
            failure = failure or error
    loop: asyncio.AbstractEventLoop | None = namespace.get(_LOOP)
    if loop is not None:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    if failure is not None:
        raise failure


def sybil_collector(root: Path) -> Callable[..., Any]:
    """The pytest collection hook for the Markdown files under ``root``."""
    return Sybil(
        parsers=[CodeBlockParser(language="python", evaluator=_evaluate), SkipParser()],
        patterns=["*.md"],
        path=str(root),
        setup=_setup,
        teardown=_teardown,
    ).pytest()

