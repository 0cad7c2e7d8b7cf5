"""Collects the Python snippets of README.md and docs/ as tests (see tests/docs_snippets.py)."""

from pathlib import Path

from tests.docs_snippets import sybil_collector

pytest_collect_file = sybil_collector(Path(__file__).parent)
