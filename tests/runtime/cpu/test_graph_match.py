"""graph_match's shared analyses: each thread's cache is its own, so Modules built in several
threads at once (as Flower's simulation builds its nodes' clients) do not see one another's."""

from __future__ import annotations

import threading

from onnx import TensorProto, helper

from traingraph.runtime.cpu import graph_match


def _graph():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    return helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])


def test_a_thread_leaving_shared_analyses_leaves_the_others_cache_alone() -> None:
    graph = _graph()
    entered, left = threading.Event(), threading.Event()
    results: list[object] = []

    def first() -> None:
        with graph_match.shared_analyses():
            graph_match.GraphIndex.of(graph)
            entered.set()
            assert left.wait(10)  # the other thread is inside when this one leaves

    def second() -> None:
        assert entered.wait(10)
        with graph_match.shared_analyses():
            left.set()
            worker.join(10)  # the first thread has left its context
            index = graph_match.GraphIndex.of(graph)
            results.append(index is graph_match.GraphIndex.of(graph))

    worker = threading.Thread(target=first)
    other = threading.Thread(target=second)
    worker.start()
    other.start()
    other.join(20)
    assert results == [True]  # cached within the thread's own context, no error
