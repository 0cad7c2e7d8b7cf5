"""The docs' own rules: every Python snippet is one the suite runs (conftest.py collects each
```python fence of README.md and docs/ with Sybil), so none may hide under another fence."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(.*)$")
PYTHON_LOOKING = re.compile(r"^(from \w[\w.]* import |import \w|async def |def |class \w|await )")
# Pages that show whole files of the repository (each run by its own test) under ```py.
INCLUDES = {"docs/examples.md"}


def _fences(path: Path) -> list[tuple[int, str, list[str]]]:
    fences: list[tuple[int, str, list[str]]] = []
    current: tuple[int, str, list[str]] | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if match and current is None:
            current = (number, match.group(1).strip(), [])
        elif match:
            fences.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, f"{path}: a fence opened at line {current[0]} is never closed"
    return fences


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_python_snippet_is_under_a_python_fence() -> None:
    hidden = []
    for path in _documents():
        name = path.relative_to(ROOT).as_posix()
        for line, language, body in _fences(path):
            if language == "python":
                continue
            if language in {"py", "python3", "py3", "pycon"} and name not in INCLUDES:
                hidden.append(f"{name}:{line}: ```{language} is not run: use ```python")
            elif language in {"", "text"} and any(PYTHON_LOOKING.match(b) for b in body):
                hidden.append(f"{name}:{line}: Python under ```{language} is not run")
    assert hidden == [], "\n".join(hidden)


def test_the_documents_hold_snippets_to_run() -> None:
    # the collector's pattern and the fence it looks for: a rename would quietly run nothing
    counts = {path.relative_to(ROOT).as_posix():
              sum(language == "python" for _, language, _ in _fences(path))
              for path in _documents()}
    assert counts["README.md"] >= 2 and sum(counts.values()) >= 15, counts
