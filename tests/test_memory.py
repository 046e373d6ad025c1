"""comera_compile.memory: bytes saved for backward and peak live bytes, against hand-counted bytes."""

from __future__ import annotations


import pytest
import torch
import torch.fx
from torch import nn

from comera_compile.memory import PeakMemory, SavedTensors, peak_bytes, saved_bytes

pytestmark = pytest.mark.usefixtures("single_thread")   # small tensors (see conftest.single_thread)


# ---------------------------------------------------------------------------------------------------------
# comera_compile.memory


def test_saved_bytes_counts_each_storage_once():
    x = torch.randn(1000, requires_grad=True)           # 4000 bytes
    # x * x saves x twice; exp saves its output: one storage each.
    assert saved_bytes(lambda: (x * x).exp()) == 4000 + 4000
    # A view of x saved next to x itself is the same storage.
    assert saved_bytes(lambda: x[10:] * x[:-10]) == 4000
    # Parameters (and modules' parameters) can be left out.
    lin = nn.Linear(100, 50)
    inp = torch.randn(8, 100, requires_grad=True)   # then the weight is kept too, for the input's gradient
    assert saved_bytes(lin, inp, exclude=lin) == 8 * 100 * 4
    assert saved_bytes(lin, inp) == 8 * 100 * 4 + 50 * 100 * 4


def test_saved_tensors_live_only_while_the_graph_is():
    x = torch.randn(256, requires_grad=True)
    with SavedTensors() as saved:
        y = x.exp()
        assert saved.bytes == 1024 and saved.storages == 1
        assert saved.breakdown() == [("(256,) torch.float32", 1024)]
        y.sum().backward()     # frees the graph and what it saved
        assert saved.bytes == 0
    with pytest.raises(TypeError, match="tensors and nn.Modules"):
        SavedTensors(exclude=[3])


def test_saved_tensors_keeps_autograd_s_in_place_check():
    x = torch.randn(5, requires_grad=True)
    with SavedTensors():
        y = x.exp()
        y.add_(1.0)             # exp's backward needs its output as it was
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_a_storage_saved_by_two_graphs_counts_while_either_lives():
    x = torch.randn(100, requires_grad=True)
    with SavedTensors() as saved:
        a = x.sin()           # saves x
        b = x.cos()           # saves x again: one storage
        assert saved.bytes == 400
        b.sum().backward()    # the second graph is gone, the first still keeps x
        assert saved.bytes == 400
        a.sum().backward()
        assert saved.bytes == 0


def test_peak_memory_follows_allocation_and_release():
    before = torch.randn(10_000)    # existed before: not counted, nor are views of it

    def work():
        a = torch.empty(1000)       # 4000
        b = torch.empty(2000)       # 8000 -> 12000 live
        v = b[:500]                 # a view: nothing new
        before.add_(1.0)            # in place on an old tensor: nothing new
        w = before[:100] * 1.0      # new: 400 -> 12400
        del a, v
        c = torch.empty(500)        # 2000 -> 10400
        return b, c, w

    with PeakMemory() as mode:
        out = work()
        assert mode.current == 8000 + 2000 + 400
    assert mode.peak == 12_400 and mode.allocated == 4000 + 8000 + 400 + 2000
    del out
    assert mode.current == 0
    assert peak_bytes(lambda: torch.ones(3, 4).sum()) == 48 + 4   # both alive at once
