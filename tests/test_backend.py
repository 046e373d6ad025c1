"""The "comera" torch.compile backend: correctness against eager, no graph breaks, registration,
the CUDA path's decisions (tested on CPU), whole-step compilation."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.backend import OPTIONS, inductor_config, repeated_blocks
from comera_compile.examples import six_encoder
from comera_compile.logs import tt_contractions
from helpers import second_compile_from_aot_cache


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tensorized_encoder(layers: int = 1) -> nn.Module:
    """The six-encoder model at the paper's shapes (preset, r = 30), reduced depth, no dropout."""
    torch.manual_seed(0)
    return cc.tensorize(six_encoder.build(layers=layers, dropout=0.0), preset="comera-six-encoder", inplace=True)


def test_compiled_matches_eager_forward_and_gradients_fullgraph():
    model = _tensorized_encoder()
    ids, seg, mask = six_encoder.example_inputs(model, batch=2, seq=16)
    mask[1, 10:] = 0
    eager_out = model(ids, seg, mask)
    eager_out.square().sum().backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    compiled = torch.compile(model, backend="comera", fullgraph=True)
    out = compiled(ids, seg, mask)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == eager_grads.keys()
    overall = max(g.abs().max() for g in eager_grads.values())
    for n in eager_grads:  # relative to the parameter's own scale; some (key biases) have ~0 gradient
        scale = torch.maximum(eager_grads[n].abs().max(), 1e-3 * overall)
        assert (grads[n] - eager_grads[n]).abs().max() / scale < 1e-4, n


def test_a_graph_entering_autocast_is_served_by_aotautograd_s_cache_and_matches_eager_autocast():
    """A compiled function that enters bf16 autocast itself (as compile_step's autocast option and user code
    do) holds torch's _enter_autocast/_exit_autocast in its graph; the backend marks them cacheable, so a
    second compile finds the graph in AOTAutograd's cache, and what the cache serves computes what eager
    autocast does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
    x = torch.randn(8, 32)

    def loss(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().square().mean()

    def step(fn):
        value = fn(x)
        value.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return value.detach(), grads

    got, got_grads = second_compile_from_aot_cache(lambda: torch.compile(loss, backend="comera"), step)
    want, want_grads = step(loss)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-3)
    assert not torch.allclose(got, model(x).square().mean())   # autocast did change the arithmetic


def test_dense_model_compiles_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
    x = torch.randn(5, 32)
    torch.testing.assert_close(torch.compile(model, backend="comera")(x), model(x), rtol=1e-5, atol=1e-6)


def _counting_backend(counts):
    def backend(gm, example_inputs):
        counts.append(gm)
        return gm.forward
    return backend


def test_new_batch_size_costs_at_most_one_recompile():
    torch.manual_seed(0)
    model = cc.tensorize(nn.Sequential(nn.Linear(96, 128), nn.ReLU(), nn.Linear(128, 96)), rank=8)
    counts = []
    compiled = torch.compile(model, backend=_counting_backend(counts), fullgraph=True)
    seen = 0
    for rows in (4, 64, 32, 8, 3, 500, 64, 4):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
        assert len(counts) - seen <= 1
        seen = len(counts)
    assert len(counts) < 6  # sizes seen before, or in the same plan segment, reuse a compiled graph


def test_mark_dynamic_recompiles_only_where_the_plan_changes():
    torch.manual_seed(0)
    model = cc.tensorize(nn.Sequential(nn.Linear(768, 3072)), preset="comera-six-encoder")
    thresholds, programs = cc.networks.tt_linear_segments(model.get_submodule("0").spec, False, False)
    assert len(programs) == len(thresholds) + 1 >= 2
    counts = []
    compiled = torch.compile(model, backend=_counting_backend(counts), fullgraph=True)
    sizes = [300, 301, 512, 1000, 2048, 4097]  # all in the last plan segment
    assert min(sizes) >= thresholds[-1]
    with torch.no_grad():
        for rows in sizes:
            x = torch.randn(rows, 768)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert len(counts) == 1


def test_unknown_option_lists_valid_ones():
    model = nn.Linear(4, 4)
    compiled = torch.compile(model, backend="comera", options={"cudagraph": False})
    with pytest.raises(Exception, match=r"\['cudagraph'\].*valid options: cudagraphs"):
        compiled(torch.randn(2, 4))


def test_options_that_are_not_a_dict_are_a_clear_error():
    compiled = torch.compile(nn.Linear(4, 4), backend="comera", options=["memory"])
    with pytest.raises(Exception, match=r"takes its options as a dict, e.g. options=\{'memory': True\}"):
        compiled(torch.randn(2, 4))
    torch._dynamo.reset()


def test_inductor_config_names_beside_the_options_reach_inductor():
    """options={"max_autotune": True}, as torch.compile takes Inductor's settings, is Inductor's patch as if given
    in 'inductor'; a joint-graph pass given that way runs in a real compile, whose gradient matches eager.  The
    same name twice with different values is an error; a name Inductor does not know is still one."""
    assert inductor_config({"cpu"}, None, {"max_autotune": True, "contraction": True})["max_autotune"] is True
    both = inductor_config({"cpu"}, None, {"epilogue_fusion": False, "inductor": {"shape_padding": False}})
    assert both["epilogue_fusion"] is False and both["shape_padding"] is False
    with pytest.raises(ValueError, match="given twice"):
        inductor_config({"cpu"}, None, {"max_autotune": True, "inductor": {"max_autotune": False}})
    with pytest.raises(ValueError, match=r"\['max_autotun'\].*not an Inductor config name"):
        inductor_config({"cpu"}, None, {"max_autotun": True})
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Counting(CustomGraphPass):
        def __call__(self, graph):
            seen.append(len(graph.nodes))

        def uuid(self):
            return "counting/1"

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    compiled = torch.compile(model, backend="comera", options={"joint_custom_pre_pass": Counting(),
                                                               "fx_graph_cache": False})
    (grad,) = torch.autograd.grad(compiled(x).sum(), x)
    (ref,) = torch.autograd.grad(model(x).sum(), x)
    assert seen and seen[0] > 0
    torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)


def test_cuda_path_decisions_on_cpu():
    assert inductor_config({"cuda"}, None, None)["triton.cudagraphs"] is True
    assert inductor_config({"cuda"}, None, {"cudagraphs": False})["triton.cudagraphs"] is False
    assert inductor_config({"cuda"}, None, {"profile": True})["triton.cudagraphs"] is False   # every kernel shows
    assert inductor_config({"cpu"}, None, None)["triton.cudagraphs"] is False
    # Inductor's Python wrapper stays the default on CPU; the C++ wrapper is the user's choice.
    assert "cpp_wrapper" not in inductor_config({"cpu"}, None, None)
    assert inductor_config({"cpu"}, None, {"inductor": {"cpp_wrapper": True}})["cpp_wrapper"] is True
    patches = inductor_config({"cuda"}, "max-autotune-no-cudagraphs", {"inductor": {"freezing": True}})
    assert patches["max_autotune"] is True and patches["freezing"] is True
    assert patches["triton.cudagraphs"] is False   # the mode says so (it turned them on for CUDA inputs)
    assert inductor_config({"cuda"}, "max-autotune", None)["triton.cudagraphs"] is True
    from comera_compile.step_modes import compile_kwargs
    folded = compile_kwargs("comera", "max-autotune-no-cudagraphs", {"contraction": True})["options"]
    assert folded["cudagraphs"] is False and folded["inductor"]["max_autotune"] is True
    assert set(OPTIONS) >= {"cudagraphs", "contraction", "inductor"}
    with pytest.raises(TypeError):
        inductor_config({"cpu"}, None, {"cudagraphs": "yes"})


@pytest.mark.parametrize("options,calls", [(None, 1), ({"keep_memory": False}, 0)])
def test_backend_keeps_freed_memory_for_cpu_inputs_unless_told_not_to(monkeypatch, options, calls):
    """torch.compile(model, backend="comera") on CPU gets the allocator setting compile_step applies."""
    import comera_compile.backend as backend

    seen = []
    monkeypatch.setattr(backend, "keep_freed_memory", lambda: seen.append(1) or True)
    model = nn.Linear(4, 2)
    kwargs = {"options": options} if options else {}
    torch.compile(model, backend="comera", **kwargs)(torch.randn(3, 4))
    assert len(seen) == calls


def test_backend_warms_the_cpu_compiler_on_a_thread_once(monkeypatch):
    """The first CPU compile starts Inductor's vector-ISA check and a one-line kernel's build (the
    precompiled header) on a thread of its own, so they overlap AOTAutograd's tracing; later compiles do
    not start it again."""
    import threading

    import torch._inductor.cpu_vec_isa as isa
    import comera_compile.backend as backend

    probed = threading.Event()
    real = isa.valid_vec_isa_list
    monkeypatch.setattr(isa, "valid_vec_isa_list", lambda: (probed.set(), real())[1])
    backend._warm_cpu_compiler_early.cache_clear()
    threads, start = [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (threads.append(self.name), start(self)))
    for _ in range(2):
        torch.compile(nn.Linear(4, 2), backend="comera")(torch.randn(3, 4))
        torch._dynamo.reset()
    assert probed.wait(60) and threads.count("comera-warm-cpu-compiler") == 1


@pytest.mark.parametrize("cpp_wrapper", [False, True])
def test_warm_thread_builds_the_header_the_generated_code_includes(monkeypatch, cpp_wrapper):
    """Inductor's C++ wrapper includes another precompiled header than its Python wrapper's kernels: the
    warm thread asks for the one the compile will use (the wrapper's with cpp_wrapper on, else a kernel's)."""
    import torch._inductor.compile_fx as compile_fx
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import CppWrapperCodeCache

    import comera_compile.backend as backend

    asked = []
    monkeypatch.setattr(CppWrapperCodeCache, "load_async", classmethod(lambda cls, *a, **k: asked.append("wrapper")))
    monkeypatch.setattr(AsyncCompile, "cpp_pybinding", lambda self, *a, **k: asked.append("kernel"))
    monkeypatch.setattr(backend, "_warm_cpu_compiler_early", backend._warm_cpu_compiler)   # on this thread
    monkeypatch.setattr(compile_fx, "compile_fx", lambda gm, example_inputs, **kw: gm.forward)
    gm = torch.fx.symbolic_trace(nn.Linear(4, 2))
    options = {"inductor": {"cpp_wrapper": True}} if cpp_wrapper else None
    with torch._inductor.config.patch(cpp_wrapper=False):
        backend.comera_backend(gm, [torch.randn(3, 4)], options=options)
    assert asked == (["wrapper"] if cpp_wrapper else ["kernel"])


def test_mask_recompute_pass_joins_the_users_joint_passes():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from comera_compile.passes.joint.recompute import RecomputeHashMasks

    seen = []

    class Mine(CustomGraphPass):
        def __call__(self, graph):
            seen.append(sum(n.op == "call_function" for n in graph.nodes))

        def uuid(self):
            return "mine/1"

    alone = inductor_config({"cpu"}, None, None)["joint_custom_pre_pass"]
    assert isinstance(alone, RecomputeHashMasks)   # a single pass: what every torch release takes
    for user in (Mine(), [Mine()]):   # a pass, or a list as torch 2.13+ takes them
        chained = inductor_config({"cpu"}, None, {"inductor": {"joint_custom_pre_pass": user}})["joint_custom_pre_pass"]
        assert isinstance(chained, CustomGraphPass) and chained.uuid()[1:] == ("mine/1", alone.uuid())
    bare = inductor_config({"cpu"}, None, {"inductor": {"joint_custom_pre_pass": lambda g: None}})
    assert bare["joint_custom_pre_pass"].uuid() is None   # a bare callable: no FX graph caching, as Inductor does
    off = inductor_config({"cpu"}, None, {"fast_dropout": False})
    assert "joint_custom_pre_pass" not in off

    # Both run in a real compile, and the training step still matches eager.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    compiled = torch.compile(model, backend="comera",
                             options={"inductor": {"joint_custom_pre_pass": Mine(), "fx_graph_cache": False}})
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    (ref,) = torch.autograd.grad(model(x).sum(), x)
    assert seen and seen[0] > 0
    torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)


def test_entry_point_registration_in_fresh_interpreter():
    code = ("import sys, torch\n"
            "assert 'comera_compile' not in sys.modules\n"
            "f = torch.compile(lambda x: x * 2 + 1, backend='comera')\n"
            "print(f(torch.ones(3)).tolist(), 'comera_compile' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[3.0,", "3.0,", "3.0]", "True"]


def test_compile_step_matches_eager_steps():
    # An MLP, not the encoder: attention's key bias gets an exactly-zero gradient, and AdamW turns the
    # rounding noise around zero into lr-sized steps of random sign in either run.
    def make():
        torch.manual_seed(0)
        dense = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 64), nn.Tanh(),
                              nn.Linear(64, 5))
        m = cc.tensorize(dense, rank=6, min_features=32)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)

    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 64, generator=g), torch.randint(0, 5, (16,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    eager, opt = make()
    for _ in range(5):
        loss_fn(eager(x), target).backward()
        opt.step()
        opt.zero_grad()
    model, opt = make()
    step = cc.compile_step(model, loss_fn, opt)
    losses = [step(x, target) for _ in range(5)]
    assert losses[-1] < losses[0]
    assert all(g["fused"] for g in opt.param_groups)   # torch's CPU default (a loop) -> fused kernels
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).norm() <= 1e-5 * q.norm() + 1e-7, n


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = cc.TTLinear(64, 96, rank=6, in_modes=(4, 4, 4), out_modes=(4, 4, 6))
        self.norm = nn.LayerNorm(96)
        self.down = cc.TTLinear(96, 64, rank=6, in_modes=(4, 4, 6), out_modes=(4, 4, 4))

    def forward(self, x):
        return x + self.down(self.norm(F.gelu(self.up(x))))


class _Stack(nn.Module):
    def __init__(self, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(_Residual() for _ in range(depth))
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_repeated_blocks_are_the_stacked_layers():
    assert len(repeated_blocks(_Stack())) == 3
    six = cc.tensorize(six_encoder.build(layers=2), preset="comera-six-encoder")
    assert repeated_blocks(six) == list(six.layers)
    torch_encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, batch_first=True), 3,
                                          enable_nested_tensor=False)
    assert repeated_blocks(torch_encoder) == list(torch_encoder.layers)
    stack = nn.Sequential(_Residual(), _Residual())   # the model itself a stack
    assert repeated_blocks(stack) == list(stack)
    # plain layers in a row are not blocks: compiling each alone would leave the model mostly eager
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))) == []
    assert repeated_blocks(nn.Sequential(cc.TTLinear(64, 64, rank=4), cc.TTLinear(64, 64, rank=4))) == []


@pytest.mark.parametrize("regional", [True, False])
def test_compile_step_compiles_one_graph_for_all_blocks_and_trains_as_eager(regional):
    """By default compile_step compiles the repeated blocks one by one: the three blocks share one graph,
    which holds no op of the input layer or the head; regional=False compiles forward and loss as one
    graph.  Either way five AdamW steps land where five eager steps do."""
    def make():
        torch.manual_seed(0)
        m = _Stack()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 32, generator=g), torch.randint(0, 5, (16,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    model, opt = make()
    step = cc.compile_step(model, loss_fn, opt, backend=counting, regional=regional)
    for _ in range(2):
        step(x, target)
    assert len(graphs) == 1
    shapes = {tuple(p.shape) for p in graphs[0].parameters()} | {
        tuple(n.meta["example_value"].shape) for n in graphs[0].graph.find_nodes(op="placeholder")
        if isinstance(n.meta.get("example_value"), torch.Tensor)}
    assert ((5, 64) in shapes) is not regional   # the head's weight: in the one whole graph only
    eager, eager_opt = make()
    for _ in range(5):
        loss_fn(eager(x), target).backward()
        eager_opt.step()
        eager_opt.zero_grad()
    torch._dynamo.reset()
    model, opt = make()
    step = cc.compile_step(model, loss_fn, opt, regional=regional)
    for _ in range(5):
        step(x, target)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).norm() <= 1e-5 * q.norm() + 1e-7, n


def test_compile_step_captures_whole_blocks_of_torch_s_own_transformer_encoder():
    """nn.TransformerEncoderLayer is torch.nn's own class: Module.compile() on it captures only the calls its
    forward makes outside torch (each TT layer alone).  compile_step's blocks are whole graphs, holding
    attention and both TT layers, shared by the blocks (a second one for the first block, whose input needs
    no gradient); the model's state_dict keys stay the user's; three steps land where eager steps do."""
    def make():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # enable_nested_tensor's note about batch_first
            m = cc.tensorize(nn.TransformerEncoder(layer, 3, enable_nested_tensor=False), rank=8, min_features=32)
        # SGD: the attention's key bias has a zero gradient (softmax ignores a shift), which Adam would
        # blow up from rounding noise to a full step of either sign
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(2, 6, 64, generator=g), torch.randn(2, 6, 64, generator=g)
    model, opt = make()
    keys = list(model.state_dict())
    step = cc.compile_step(model, nn.MSELoss(), opt, backend=counting)
    for _ in range(2):
        step(x, target)
    assert len(graphs) <= 2
    for graph in graphs:
        assert "multi_head_attention_forward" in graph.code and "layer_norm" in graph.code
        assert {"linear1", "linear2"} <= {layer.layer.rsplit(".", 1)[-1] for layer in tt_contractions(graph)}
    assert list(model.state_dict()) == keys
    eager, eager_opt = make()
    torch._dynamo.reset()
    model, opt = make()
    step = cc.compile_step(model, nn.MSELoss(), opt)
    for _ in range(3):
        step(x, target)
        nn.MSELoss()(eager(x), target).backward()
        eager_opt.step()
        eager_opt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).norm() <= 1e-5 * q.norm() + 1e-7, n


def test_compile_step_falls_back_to_foreach_without_a_fused_kernel():
    model = nn.Linear(4, 2)
    opt = torch.optim.RMSprop(model.parameters())
    cc.compile_step(model, nn.MSELoss(), opt, backend="eager")(torch.randn(3, 4), torch.randn(3, 2))
    assert opt.param_groups[0]["foreach"] is True


def test_compile_step_keeps_an_explicit_optimizer_implementation():
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    step = cc.compile_step(model, nn.MSELoss(), opt, backend="eager")
    step(torch.randn(3, 4), torch.randn(3, 2))
    assert opt.param_groups[0]["foreach"] is False


class _RecordingRankAdaptive(cc.RankAdaptive):
    """A RankAdaptive recording each step's loss, result and whether dynamo was tracing the call; its
    step number `switch_off_at` first zeroes a gate slice in every layer (as if the proximal step had)."""

    def __init__(self, *args, switch_off_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.switch_off_at = [], switch_off_at

    def step(self, loss=None):
        if len(self.calls) + 1 == self.switch_off_at:
            with torch.no_grad():
                for layer in self.layers.values():
                    layer.gates[0][0] = 0.0
        reallocated = super().step()
        self.calls.append((loss, reallocated, torch.compiler.is_compiling()))
        return reallocated


def test_compile_step_runs_the_rank_adaptive_step_after_each_step_eagerly():
    """compile_step(..., rank_adaptive=ra): every step ends with ra.step(loss), outside the compiled code
    (no graph is compiled for it, dynamo never traces it), and six steps with a re-allocation (cut_every=2,
    realloc_at=1.0, a slice switched off in every layer before the first cut check) land where an eager
    loop does."""
    from comera_compile.backend import comera_backend
    from comera_compile.optim import param_groups

    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 64, generator=g), torch.randint(0, 5, (16,), generator=g)
    loss_fn = nn.CrossEntropyLoss()

    def run(compiled: bool):
        torch.manual_seed(0)
        dense = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.Tanh(), nn.Linear(64, 5))
        model = cc.tensorize(dense, rank=6, min_features=32)
        opt = torch.optim.AdamW(param_groups(model, lr=1e-3), weight_decay=0.0)
        ra = _RecordingRankAdaptive(model, optimizer=opt, cut_every=2, realloc_at=1.0, switch_off_at=2)
        graphs, counts, losses = [], [], []

        def counting(gm, example_inputs):
            graphs.append(gm)
            return comera_backend(gm, example_inputs)

        step = cc.compile_step(model, lambda out, t: ra.loss(loss_fn(out, t)), opt, backend=counting,
                               rank_adaptive=ra)
        for i in range(6):
            if compiled:
                losses.append(step(x, target))
            else:
                loss = ra.loss(loss_fn(model(x), target))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
                ra.step(losses[-1])
            counts.append(len(graphs))
        return model, ra, losses, counts

    model, ra, losses, counts = run(True)
    eager, eager_ra, eager_losses, _ = run(False)
    assert len(ra.calls) == 6 and all(c[0] is loss for c, loss in zip(ra.calls, losses))   # once per step
    assert not any(c[2] for c in ra.calls)                               # never under dynamo
    reallocated = [c[1] for c in ra.calls]
    assert any(reallocated) and reallocated == [c[1] for c in eager_ra.calls]
    for i in range(1, 6):   # a graph is compiled at the first step and after a re-allocation only
        assert counts[i] == counts[i - 1] or reallocated[i - 1], (i, counts)
    assert ra.ranks() == eager_ra.ranks()
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.shape == q.shape and (p - q).norm() <= 1e-4 * q.norm() + 1e-6, n


def test_memory_option_applies_the_tempo_passes(caplog):
    caplog.set_level(logging.INFO, logger="comera_compile.tempo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4)).double()
    x = torch.randn(6, 32, dtype=torch.float64, requires_grad=True)
    ref = model(x)
    (gx_ref,) = torch.autograd.grad(ref.sum(), x)
    out = torch.compile(model, backend="comera", options={"memory": True})(x)
    (gx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-10, atol=1e-12)
    assert "gelu" in caplog.text.lower() and "layer_norm" in caplog.text.lower().replace("layernorm", "layer_norm")


_FAULTS = """
import resource, statistics, sys, torch
from comera_compile.backend import keep_freed_memory
if sys.argv[1] == "keep" and not keep_freed_memory():
    print("unsupported")
    raise SystemExit
if sys.argv[1] == "default":   # glibc's documented 128 KiB threshold, fixed (no dynamic raise)
    import ctypes
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)
faults = []
for it in range(12):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [torch.ones(4 << 20) for _ in range(6)]   # a step's worth of 16 MB activations, then freed
    del bufs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(statistics.median(faults[2:]))
"""


def test_keep_freed_memory_stops_steady_state_page_faults():
    """After keep_freed_memory(), re-allocating a freed step's worth of buffers touches pages the
    process already has: no page faults per iteration, where glibc's default threshold (held fixed here;
    glibc raises it as it goes, which makes the default's faults depend on the history) faults them in
    again."""
    def faults(mode: str) -> str:
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
        return out.stdout.strip()

    kept = faults("keep")
    if kept == "unsupported":
        pytest.skip("not glibc")
    assert float(kept) < 16 <= float(faults("default"))
