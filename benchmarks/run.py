"""Benchmark traingraph's training step against its peers: ``python benchmarks/run.py --help``.

The same as ``traingraph bench``; the logic lives in :mod:`traingraph.bench`.
"""

import sys

from traingraph.bench import main

if __name__ == "__main__":
    sys.exit(main())
