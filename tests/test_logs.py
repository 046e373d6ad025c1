"""Seeing what the backend did: torch's logs (TORCH_LOGS, set_logs), its structured trace (TORCH_TRACE and
tlparse), cc.rewritten_graphs and `comera-compile inspect` on models torch.fx cannot trace."""

from __future__ import annotations

import importlib

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.layers import TTLayer, TTLinear
from comera_compile.logs import _clean_path
from helpers import readme_block, readme_commands

# A tensorized model small enough for Inductor to compile in seconds: two TT layers and a dropout.
_SCRIPT = textwrap.dedent("""
    import logging, sys, torch
    from torch import nn
    import comera_compile as cc

    torch.manual_seed(0)
    model = cc.tensorize(nn.Sequential(nn.Linear(256, 512), nn.Dropout(0.1), nn.Linear(512, 256)), rank=8)
    x = torch.randn(16, 256, requires_grad=True)
    if sys.argv[1:] == ["set_logs"]:
        torch.compile(model, backend="comera")(x).sum().backward()
        print("== set_logs ==", file=sys.stderr, flush=True)
        torch._dynamo.reset()
        torch._logging.set_logs(modules={"comera": logging.INFO, "comera_graphs": True})
    torch.compile(model, backend="comera")(x).sum().backward()
    print("compiled", model[0].plan(16).flops, model[2].plan(16).flops)
""")


def _run(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "compile_it.py"
    script.write_text(_SCRIPT)
    full = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_TRACE")}
    full.update(env)
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=full,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _flops(stdout: str) -> tuple[int, int]:
    line = next(line for line in stdout.splitlines() if line.startswith("compiled"))
    return int(line.split()[1]), int(line.split()[2])


def _si(x: int) -> str:
    from comera_compile.logs import _si as si

    return si(x)


def test_torch_logs_prints_a_summary_per_graph_and_the_graphs_only_when_asked(tmp_path):
    summary = _run(tmp_path, {"TORCH_LOGS": "comera_compile"})
    f0, f2 = _flops(summary.stdout)
    # One summary, naming both TT layers with the rows and the forward FLOPs of the plan each layer chose
    # (the planner's cost model; the log counts the graph's matmul shapes).
    assert summary.stderr.count("comera graph 0/0:") == 1, summary.stderr
    assert "0: TTLinear, 16 rows, " in summary.stderr and f"{_si(f0)}FLOP" in summary.stderr
    assert "2: TTLinear, 16 rows, " in summary.stderr and f"{_si(f2)}FLOP" in summary.stderr
    assert "fast_dropout 1" in summary.stderr and "then Inductor" in summary.stderr
    assert "comera graph after" not in summary.stderr   # the graphs are the DEBUG level's

    verbose = _run(tmp_path, {"TORCH_LOGS": "+comera_compile"})
    assert "comera graph 0/0:" in verbose.stderr
    assert "comera graph after dynamo:" in verbose.stderr and "comera graph after fast_dropout:" in verbose.stderr
    assert "hash_dropout" in verbose.stderr.split("comera graph after fast_dropout:")[1]
    assert "comera contractions:" in verbose.stderr
    # without TORCH_LOGS nothing of comera's is printed: test_set_logs_takes_the_registered_names_after_import


def test_set_logs_takes_the_registered_names_after_import(tmp_path):
    out = _run(tmp_path, {}, "set_logs")
    before, after = out.stderr.split("== set_logs ==")
    assert "comera" not in before
    assert "comera graph 0/0:" in after and "comera graph after dynamo:" in after


def test_torch_trace_report_from_tlparse_lists_comera_s_artifacts(tmp_path):
    tlparse = Path(sys.executable).with_name("tlparse")
    if not tlparse.exists():
        pytest.skip("tlparse is not installed (pip install -e '.[test]' installs it)")
    trace = tmp_path / "trace"
    _run(tmp_path, {"TORCH_TRACE": str(trace)})
    logs = list(trace.glob("*.log"))
    assert logs, list(trace.iterdir())
    report = tmp_path / "report"
    subprocess.run([str(tlparse), str(logs[0]), "-o", str(report), "--no-browser", "--overwrite"], check=True,
                   capture_output=True, timeout=120)
    index = (report / "index.html").read_text()
    for name in ("comera_summary", "comera_graph_dynamo", "comera_graph_fast_dropout"):
        assert name in index, name
    summary = next(report.rglob("comera_summary*.txt")).read_text()
    assert "comera graph 0/0:" in summary and "0: TTLinear, 16 rows" in summary


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
    return cc.tensorize(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), rank=8)


def test_rewritten_graphs_finds_every_tt_layer_with_its_plan_s_flops():
    model = _encoder()
    x = torch.randn(2, 8, 128)
    reports = cc.rewritten_graphs(model, x)
    assert len(reports) == 1
    found = {layer.layer: layer for layer in reports[0].layers}
    tt = {name: m for name, m in model.named_modules() if isinstance(m, TTLayer)}
    assert set(found) == set(tt) and len(tt) == 4
    for name, layer in found.items():
        assert layer.rows == 16 and layer.kind == "TTLinear"
        assert layer.flops == tt[name].plan(16).flops, name   # graph matmul shapes vs the planner's count
    assert reports[0].passes["fast_dropout"] == 6   # three dropouts per encoder layer
    assert "hash_dropout" in reports[0].code and "[layers.1.linear2]" in reports[0].code


def test_rewritten_graphs_any_number_of_times_leaves_torch_compile_of_the_model_compiling():
    """Each call captures on a code object of its own: a dozen calls (beyond dynamo's recompile limit of 8 per
    code object) all report the graph, and torch.compile of the model afterwards still compiles it."""
    torch._dynamo.reset()
    model = cc.tensorize(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), rank=4)
    assert [len(cc.rewritten_graphs(model, torch.randn(2, 64))) for _ in range(12)] == [1] * 12
    calls = []

    def counting(gm, example_inputs):
        calls.append(1)
        return gm.forward

    torch.compile(model, backend=counting)(torch.randn(2, 64))
    assert calls == [1]
    torch._dynamo.reset()


def test_rewritten_graphs_leaves_the_model_and_the_generator_as_they_were():
    model = nn.Sequential(nn.Linear(256, 512), nn.BatchNorm1d(512), nn.Dropout(0.5), nn.Linear(512, 256))
    model = cc.tensorize(model, rank=8)
    running = model[1].running_mean.clone()
    x = torch.randn(8, 256)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    cc.rewritten_graphs(model, x)
    assert torch.equal(torch.rand(4), expected)
    assert torch.equal(model[1].running_mean, running) and model[1].num_batches_tracked.item() == 0


def test_a_graph_break_gives_one_report_per_graph():
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = TTLinear(256, 256, rank=4), TTLinear(256, 256, rank=4)

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x)

    reports = cc.rewritten_graphs(Broken(), torch.randn(3, 256))
    assert [[layer.layer for layer in r.layers] for r in reports] == [["a"], ["b"]]


def test_the_contraction_pass_s_own_figures_are_reported_for_a_torch_fx_graph():
    from comera_compile.logs import tt_contractions
    from comera_compile.passes.fx.contraction import expand_contractions

    gm = cc.tensorize(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)), rank=8, trace=True)
    expand_contractions(gm, [torch.randn(16, 256)])
    layers = tt_contractions(gm)
    assert [(layer.layer, layer.rows) for layer in layers] == [("0", 16), ("2", 16)]
    for layer in layers:
        plan = gm.get_submodule(layer.layer).plan(16)
        assert [s.equation for s in layer.steps] == list(plan.equations)
        assert layer.flops == plan.flops


@pytest.mark.parametrize("source, name", [
    ("L['self'].layers[0].linear1", "layers.0.linear1"),
    ("L['self']._modules['encoder']._modules['layer']._modules['0']", "encoder.layer.0"),
    ("L['args'][0].model.embed_tokens", "model.embed_tokens"),
    ("L['fn'].layers.0.ffn", "layers.0.ffn"),
    ("L['self']._modules['q']._parameters['bias']", "q.bias"),
])
def test_dynamo_sources_read_as_qualified_names(source, name):
    assert _clean_path(source) == name


_FACTORIES = textwrap.dedent("""
    import transformers

    def bert():
        return transformers.BertModel(transformers.BertConfig(
            vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64))

    def llama():
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64))
""")


@pytest.mark.parametrize("factory", ["bert", "llama"])
def test_inspect_prints_the_compiled_graph_of_a_transformers_model(factory, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from comera_compile.cli import main

    (tmp_path / "hf_factories.py").write_text(_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["inspect", f"hf_factories:{factory}", "--rank", "8"]) == 0
    out = capsys.readouterr().out
    assert "torch.fx cannot trace it" in out and "graph 1 of 1 that torch.compile(backend='comera')" in out
    # Every TT layer of the table appears in the graph, its ops marked with its name.
    table = [line.split()[0] for line in out.splitlines()
             if len(line.split()) > 1 and line.split()[1] in ("TTLinear", "TTEmbedding")]
    assert len(table) >= 10, out
    for name in table:
        assert f"[{name}]" in out, name


_NEEDS_INPUTS = textwrap.dedent("""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.a(x) if x.dim() > 1 else x   # torch.fx cannot trace the branch on x

    def net():
        return Net()
""")


def test_inspect_asked_for_the_dynamo_graph_without_inputs_fails_saying_what_to_pass(tmp_path, monkeypatch,
                                                                                      capsys):
    """--graph dynamo is a graph asked for: where it cannot be shown (no --input), the command fails saying
    what to pass, instead of a comment and exit status 0; at --graph auto the comment stays."""
    from comera_compile.cli import main

    (tmp_path / "own_nets.py").write_text(_NEEDS_INPUTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit, match=r"--graph dynamo: Net needs example inputs.*--input SHAPE"):
        main(["inspect", "own_nets:net", "--rank", "4", "--graph", "dynamo"])
    assert main(["inspect", "own_nets:net", "--rank", "4"]) == 0
    assert "# no graph: Net needs example inputs" in capsys.readouterr().out


def test_inspect_of_a_factory_that_tensorizes_refuses_a_rank_it_would_not_use(tmp_path, monkeypatch, capsys):
    """A factory returning a model with TT layers already: --rank (which tensorize would leave unused) is an
    error saying what to do, and without it the last line counts the model's own parameters, not "dense"."""
    from comera_compile.cli import main

    (tmp_path / "own_tt.py").write_text(
        "import comera_compile as cc\nfrom torch import nn\n\n"
        "def build():\n    return cc.tensorize(nn.Sequential(nn.Linear(128, 128), nn.ReLU()), rank=8)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit, match=r"TT layers already.*drop --rank"):
        main(["inspect", "own_tt:build", "--rank", "4"])
    assert main(["inspect", "own_tt:build"]) == 0
    out = capsys.readouterr().out
    tt_params = sum(p.numel() for p in importlib.import_module("own_tt").build().parameters())
    assert f"Sequential: {tt_params:,} parameters as the factory built it" in out and "dense parameters" not in out


def test_readme_seeing_section_commands_are_ones_the_cli_takes():
    """Every comera-compile command of the README's "Seeing what it did" block parses (a bracket is
    notation for an optional argument, dropped); the TORCH_LOGS names are the package's module name."""
    from comera_compile.cli import build_parser

    commands = readme_commands("Seeing what it did")
    ran = 0
    for cmd in commands:
        if cmd[0] == "comera-compile":
            words, depth = [], 0
            for word in cmd[1:]:
                depth += word.startswith("[")
                if depth == 0:
                    words.append(word)
                depth -= word.endswith("]")
            assert build_parser().parse_args(words).command in ("inspect", "bench")
            ran += 1
        elif cmd[0].startswith("TORCH_LOGS="):
            assert cmd[0].split("=", 1)[1].lstrip("+") == cc.__name__
    assert ran == 4


def test_readme_compiled_profile_snippet_runs_as_written(capsys):
    """The README's compiled-profile lines, run as written on a tensorized encoder: the table names every
    TT layer."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    model = cc.tensorize(nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                       nn.Linear(64, 48)), rank=8, min_features=32)
    names = {n for n, m in model.named_modules() if isinstance(m, TTLayer)}
    assert len(names) == 5
    scope = {"cc": cc, "model": model, "loss_fn": nn.MSELoss(), "ids": torch.randn(2, 6, 64),
             "target": torch.randn(2, 6, 48), "opt": torch.optim.SGD(model.parameters(), lr=1e-3)}
    exec(readme_block("Seeing what it did", "python"), scope)
    out = capsys.readouterr().out
    assert all(f"{name} " in out for name in names), out
