"""Cheap forward values computed again for the gradient pass give the same outputs, bit for
bit, and the forward copies are no longer read by gradient nodes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch

import traingraph
from traingraph.losses import CrossEntropyLoss
from traingraph.program import build_program
from traingraph.runtime.rewrites import recompute
from traingraph.runtime.rewrites.specialize import for_cuda


class _Block(torch.nn.Module):
    """A GELU MLP and attention probabilities with NaN rows zeroed, as torch exports
    ``scaled_dot_product_attention``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(x)))
        q = h.unsqueeze(1)  # one head
        causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=causal)
        return self.head(a.mean(dim=(1, 2)))


def _program():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = traingraph.from_torch(_Block(), torch.zeros(2, 5, 8))
    return build_program(model, loss=CrossEntropyLoss())


def test_gelu_and_zeroed_probabilities_are_computed_again_with_the_same_outputs() -> None:
    program = _program()
    train = program.train_model
    model = ir.serde.deserialize_model(train)
    assert recompute.RecomputeInBackward()(model).modified
    copies = [n for n in model.graph if (n.name or "").endswith("/recomputed")]
    # the GELU's output and the scaled query; the probabilities with NaN rows zeroed are what
    # the Softmax gradient reads (in place of the probabilities), so they are held, not copied
    assert sorted(n.op_type for n in copies) == ["Gelu", "Mul"]
    position = {n: i for i, n in enumerate(model.graph)}
    first = min(i for n, i in position.items() if (n.name or "").startswith("grad/"))
    for copy in copies:
        assert position[copy] >= first
        original = next(n for n in model.graph if n.name == copy.name.rsplit("/", 1)[0])
        # the forward copy's readers are forward nodes only; the gradient nodes read the copy
        assert all(position[use.node] < first for use in original.outputs[0].uses())
        assert copy.outputs[0].uses()
    rewritten = ir.serde.serialize_model(model)
    source = rewritten.SerializeToString()
    assert recompute.disabled_optimizers(source) == ["CommonSubexpressionElimination"]
    assert recompute.disabled_optimizers(train.SerializeToString()) == []

    rng = np.random.default_rng(0)
    feeds = dict(program.parameters)
    x = rng.standard_normal((4, 5, 8)).astype(np.float32)
    x[0, 0, 0] = np.nan  # a NaN row of probabilities in the first sample
    feeds.update(zip(program.input_names, (x, rng.integers(0, 3, 4).astype(np.int64))))
    expected = ort.InferenceSession(
        train.SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, feeds)
    session = ort.InferenceSession(
        source,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=recompute.disabled_optimizers(source),
    )
    got = session.run(None, feeds)
    for name, a, b in zip([o.name for o in train.graph.output], expected, got):
        np.testing.assert_array_equal(b, a, err_msg=name)


def test_cuda_sessions_apply_it_where_asked_and_eval_graphs_stay() -> None:
    program = _program()
    source = program.train_model.SerializeToString()
    rewritten = onnx.load_from_string(for_cuda(source, recompute=True))
    assert any(n.name.endswith("/recomputed") for n in rewritten.graph.node)
    plain = for_cuda(source)
    assert isinstance(plain, bytes) and not recompute.disabled_optimizers(plain)
    model = ir.serde.deserialize_model(program.eval_model)
    assert not recompute.RecomputeInBackward()(model).modified
