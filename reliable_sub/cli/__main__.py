"""``python -m reliable_sub.cli``: the ``reliable-sub`` command."""

from reliable_sub.cli import main

main()
