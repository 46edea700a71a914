"""The unrolled gradients of several recurrent nodes keep their dimension names apart."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import traingraph  # noqa: E402
from traingraph import artifacts  # noqa: E402
from traingraph.api import CheckpointState  # noqa: E402


class TwoLSTMs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.LSTM(4, 8, batch_first=True)
        self.second = torch.nn.LSTM(8, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.first(x)
        h, _ = self.second(h)
        return self.head(h[:, -1])


def _run_every_value(model: onnx.ModelProto, feeds: dict) -> dict[str, tuple[int, ...]]:
    """The shape of every float value of ``model`` on ``feeds``."""
    known = {o.name for o in model.graph.output}
    extra = [
        vi
        for vi in model.graph.value_info
        if vi.name not in known and vi.type.HasField("tensor_type")
    ]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(extra)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return {n: np.asarray(v).shape for n, v in zip(names, session.run(names, feeds))}


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_dimension_name_stands_for_one_size(tmp_path, exporter) -> None:
    torch.manual_seed(0)
    model = traingraph.from_torch(TwoLSTMs(), torch.randn(2, 5, 4), exporter=exporter)
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path
    )
    train = onnx.load(str(tmp_path / "training_model.onnx"))
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    params = {name: p.data for name, p in state.parameters.items()}
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 5, 4)).astype(np.float32)}
    feeds["labels"] = rng.integers(0, 3, 3).astype(np.int64)
    for vi in train.graph.input:
        if vi.name in params:
            feeds[vi.name] = params[vi.name]
    assert set(feeds) == {vi.name for vi in train.graph.input}
    shapes = _run_every_value(train, feeds)
    sizes: dict[str, set[int]] = {}
    for vi in train.graph.value_info:
        if vi.name not in shapes:
            continue
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.dim_param:
                sizes.setdefault(d.dim_param, set()).add(shapes[vi.name][axis])
    shared = {name: s for name, s in sizes.items() if len(s) > 1}
    assert not shared, f"dimension names that stand for several sizes: {shared}"
