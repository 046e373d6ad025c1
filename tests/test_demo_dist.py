"""`comera-compile demo --nproc 2` (torchrun, gloo on CPU): each process trains on its rows of every global
batch, and the run follows the one-process run of the same global batch (dense and CoMERA, a RankAdaptive
re-allocation mid-run included), with the same held-out evaluation; bad process counts are clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from comera_compile.cli import main  # noqa: E402
from comera_compile.examples import code_mlm, demo_dist  # noqa: E402
from test_demo import _write_corpus  # noqa: E402
from helpers import readme_commands  # noqa: E402

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed gloo")

# Late stage from step 30 toward a tenth of the size, a check every 5 steps: a re-allocation comes about
# step 45, so the last steps run on cut cores (a new DDP wrapper, FSDP2 re-sharded, one recompile).
SHORT = ["--size", "tiny", "--steps", "60", "--cut-every", "5", "--target-ratio", "0.1", "--batch", "8",
         "--seq-len", "32", "--vocab-size", "300", "--eval-blocks", "8", "--evals", "2", "--no-progress"]


def _demo(tmp_path, name: str, *extra: str) -> dict:
    """The demo as a user starts it, in a fresh process; its results.json."""
    data = tmp_path / "data"
    if not data.exists():
        _write_corpus(data)
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "comera_compile", "demo", "--data", str(data), "--out", str(out),
                           *SHORT, *extra], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def _check_follows(one: dict, many: dict, processes: int) -> None:
    """Every step's loss, the held-out figures, the ranks and the re-allocation steps of the multi-process
    run equal the one-process run's, up to float32 summation order (1e-4 relative: Adam divides by the
    root of the second moment, which magnifies last-bit differences early on)."""
    assert many["processes"] == processes and one["processes"] == 1
    for name in ("dense", "comera"):
        a, b = one["runs"][name], many["runs"][name]
        assert f"x {processes} processes" in b["execution"]
        assert a["steps"] == b["steps"] == 60
        assert a["history"]["loss"] == pytest.approx(b["history"]["loss"], rel=1e-4)
        assert [e["step"] for e in a["evals"]] == [e["step"] for e in b["evals"]]
        for ea, eb in zip(a["evals"], b["evals"]):
            assert ea["masked_tokens"] == eb["masked_tokens"]   # the same held-out evaluation
            assert eb["loss"] == pytest.approx(ea["loss"], rel=1e-4)
            assert abs(eb["accuracy"] - ea["accuracy"]) <= 1 / ea["masked_tokens"] + 1e-12
        assert a["params_encoder"] == b["params_encoder"]
    table = (Path(many["config"]["out"]) / "table.md").read_text()
    assert f"{processes} processes ({many['config']['parallel'].upper()})" in table
    a, b = one["runs"]["comera"], many["runs"]["comera"]
    assert a["ranks"] == b["ranks"] and a["cuts"] == b["cuts"] >= 2
    assert len(a["compile_steps"]) >= 2 and a["compile_steps"] == b["compile_steps"], a["compile_steps"]


@needs_gloo
@pytest.mark.slow   # about 5 min: test_ddp's two-process tests cover the training it wraps
def test_demo_on_two_processes_follows_one_process(tmp_path):
    """DDP (the default) with the encoder layers compiled by backend "comera" (the default)."""
    one = _demo(tmp_path, "one", "--threads", "1")
    two = _demo(tmp_path, "two", "--nproc", "2")
    _check_follows(one, two, 2)


@needs_gloo
@pytest.mark.slow
def test_demo_fsdp2_on_two_processes_follows_one_process(tmp_path):
    one = _demo(tmp_path, "one", "--threads", "1")
    two = _demo(tmp_path, "fsdp", "--nproc", "2", "--parallel", "fsdp")
    _check_follows(one, two, 2)


def test_nproc_that_does_not_divide_the_batch_is_an_error_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"--batch 8 does not split evenly over 3 processes.*--batch 9"):
        main(["demo", "--nproc", "3", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="--nproc must be at least 1"):
        main(["demo", "--nproc", "0", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_world_that_does_not_divide_the_batch_is_an_error(tmp_path, monkeypatch):
    """Started by torchrun directly (no --nproc to check first): the run itself refuses."""
    monkeypatch.setattr(code_mlm, "from_env", lambda device, parallel: demo_dist.World(rank=0, size=3))
    with pytest.raises(code_mlm.DemoError, match="does not split evenly over 3 processes"):
        code_mlm.run(code_mlm.DemoConfig(out=tmp_path / "out", size="tiny", steps=1, minutes=None))


def test_one_process_world_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    world = demo_dist.from_env("cpu")
    assert (world.rank, world.size, world.main, world.owns_group) == (0, 1, True, False)
    assert world.rows(8) == slice(0, 8)
    assert demo_dist.World(rank=1, size=2).rows(8) == slice(4, 8)
    assert demo_dist.agree(world, 0.5, 2.0) == (0.5, 2.0)
    with pytest.raises(ValueError, match="parallel must be one of ddp, fsdp"):
        demo_dist.from_env("cpu", "zero")


def test_readme_distributed_commands_are_ones_the_tools_take():
    """Every command of the README's Distributed block parses: the demo's options with comera-compile's own
    parser, torchrun's with torchrun's (the short runs above start the same commands)."""
    from torch.distributed.run import get_args_parser

    from comera_compile.cli import build_parser

    commands = readme_commands("Distributed")
    assert len(commands) == 4
    for cmd in commands:
        if cmd[0] == "torchrun":
            launcher = get_args_parser().parse_args(cmd[1:])
            assert launcher.module and launcher.training_script == "comera_compile"
            demo = launcher.training_script_args
        else:
            assert cmd[0] == "comera-compile"
            demo = cmd[1:]
        args = build_parser().parse_args(demo)
        assert args.command == "demo"
        if cmd[0] != "torchrun":
            assert args.nproc == 2


@needs_gloo
@pytest.mark.slow
def test_readme_torchrun_line_runs_the_demo(tmp_path):
    """The README's torchrun line as written (python -m torch.distributed.run for torchrun), short."""
    cmd = next(c for c in readme_commands("Distributed") if c[0] == "torchrun" and "--nnodes" not in c)
    data = tmp_path / "data"
    _write_corpus(data)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *cmd[1:], "--data", str(data),
                           "--out", str(tmp_path / "out"), *SHORT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["processes"] == 2
