"""``python -m traingraph``: the ``traingraph`` command line."""

from traingraph.cli import main

main()
