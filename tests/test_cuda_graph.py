"""The CUDA-graph cache logic (capture itself runs in tests/gpu): bounded, least recently used first."""

import torch

from pipelines import cuda_graph
from pipelines.cuda_graph import GraphedStep


def test_graph_cache_keeps_the_most_recent_shapes(monkeypatch):
    captures = []

    class FakeCapture:
        def __init__(self, step, inputs):
            captures.append(inputs[0].shape[0])
            self.step = step

        def __call__(self, inputs):
            return self.step(*inputs)

    monkeypatch.setattr(cuda_graph, "_Captured", FakeCapture)
    graphed = GraphedStep(lambda x, mask: x * 2, max_graphs=2)
    for n in (1, 2, 1, 3, 2):
        assert torch.equal(graphed(torch.ones(n), None), torch.full((n,), 2.0))
    assert captures == [1, 2, 3, 2]  # the second 1 replays; 3 evicts 2, then 2 evicts 1
    assert [key[0][0] for key in graphed.graphs] == [(3,), (2,)]
