"""The CUDA-graph cache logic (capture itself runs in tests/gpu): bounded, least recently used first."""

import torch

from qwen_image_fusion.pipelines import cuda_graph
from qwen_image_fusion.pipelines.cuda_graph import GraphedStep


def test_graph_cache_keeps_the_most_recent_shapes(monkeypatch):
    captures = []

    class FakeCapture:
        def __init__(self, step, inputs, cut_collectives):
            captures.append(inputs[0].shape[0])
            self.step = step

        def __call__(self, inputs):
            return self.step(*inputs)

    monkeypatch.setattr(cuda_graph, "_Captured", FakeCapture)
    graphed = GraphedStep(lambda x, mask: x * 2, max_graphs=2)
    for n in (1, 2, 1, 3, 2):
        assert torch.equal(graphed(torch.ones(n), None), torch.full((n,), 2.0))
    assert captures == [1, 2, 3, 2]  # the second 1 replays; 3 evicts 2, then 2 evicts 1
    assert [key[2][0] for key in graphed.graphs] == [(3,), (2,)]  # (static, step cache, inputs...)


def test_static_arguments_are_part_of_the_key_and_reach_the_step(monkeypatch):
    class FakeCapture:
        def __init__(self, step, inputs, cut_collectives):
            self.step = step

        def __call__(self, inputs):
            return self.step(*inputs)

    monkeypatch.setattr(cuda_graph, "_Captured", FakeCapture)
    graphed = GraphedStep(lambda x, factor: x * factor)
    assert torch.equal(graphed(torch.ones(2), static=(3,)), torch.full((2,), 3.0))
    assert torch.equal(graphed(torch.ones(2), static=(5,)), torch.full((2,), 5.0))
    assert len(graphed.graphs) == 2
