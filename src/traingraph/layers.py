"""The layers of the graph API (see :mod:`traingraph.graph.layers`)."""

from traingraph.graph.layers import *  # noqa: F403
from traingraph.graph.layers import __all__  # noqa: F401
