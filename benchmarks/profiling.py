"""What the TT layers' profiler hooks cost while the profiler is off, and what the backend's profile option
costs while on (opt-in: ``--only profiling``).

A: the layers as shipped (each forward checks whether torch's profiler records); B: the same layers with
the undecorated forward (no check at all).  Interleaved in one process, medians; the ratio A/B is the
hooks' cost.  Two cases: one TT linear at 1 row, forward only (the check's cost is largest relative to the
work there), and the six-encoder eager AdamW step at batch 1 x 128.  Then the six-encoder's compiled step
(cc.compile_step) with the backend's profile option against the default compile.  Also the per-layer
tables of ``cc.profile`` for those steps (what ``comera-compile bench --profile`` prints).
"""

from __future__ import annotations

import torch
from torch import nn

import comera_compile as cc
from comera_compile.embedding import TTEmbedding, TTEmbeddingBag
from comera_compile.layers import TTLinear

from .common import compare, eager_step, format_flat_rows

__all__ = ["run", "format_rows", "without_hooks", "six_encoder_profile"]


class _PlainLinear(TTLinear):
    forward = TTLinear.forward.__wrapped__


class _PlainEmbedding(TTEmbedding):
    forward = TTEmbedding.forward.__wrapped__


class _PlainEmbeddingBag(TTEmbeddingBag):
    forward = TTEmbeddingBag.forward.__wrapped__


_PLAIN = {TTLinear: _PlainLinear, TTEmbedding: _PlainEmbedding, TTEmbeddingBag: _PlainEmbeddingBag}


def without_hooks(model: nn.Module) -> nn.Module:
    """The model's TT layers, in place, as subclasses whose forward is the undecorated one (no profiler
    check): the same parameters and computation."""
    for m in model.modules():
        if type(m) in _PLAIN:
            m.__class__ = _PLAIN[type(m)]
    return model


def _six_encoder(batch: int, layers: int, hooks: bool = True, compiled: bool = False, profile: bool = True,
                 device: str = "cpu"):
    from comera_compile.examples import six_encoder

    torch.manual_seed(0)
    model = cc.tensorize(six_encoder.build(layers=layers), preset="comera-six-encoder").to(device)
    if not hooks:
        without_hooks(model)
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-4))
    ids, seg, mask = (t.to(device) for t in six_encoder.example_inputs(model, batch=batch, seq=128))
    target = torch.zeros(batch, dtype=torch.long, device=device)
    if compiled:
        step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, options={"profile": True} if profile else None)
    else:
        step = eager_step(model, opt, nn.CrossEntropyLoss())
    return model, lambda: step(ids, seg, mask, target)


def six_encoder_profile(batch: int = 8, layers: int = 6, steps: int = 3, compiled: bool = False,
                        device: str = "cpu") -> "cc.LayerProfile":
    """cc.profile of the six-encoder's AdamW step at batch x 128 on `device`: eager, or compiled
    (cc.compile_step with the backend's profile option: each TT layer's part of the blocks' graph compiled
    on its own).  On CUDA the table is the layers' kernel time against the time the device was busy."""
    model, step = _six_encoder(batch, layers, compiled=compiled, device=device)
    return cc.profile(step, model=model, steps=steps)


def run(quick: bool = False) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    layer = TTLinear(768, 768, rank=30)
    plain = without_hooks(TTLinear(768, 768, rank=30))
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(1, 768)

    def forward(module: nn.Module):
        def call() -> object:
            with torch.no_grad():
                return module(x)
        return call

    repeat = 7 if quick else 21
    res = compare({"hooks": forward(layer), "no hooks": forward(plain)}, warmup=50, repeat=repeat, min_time=0.05)
    rows.append({"benchmark": "TT linear 768x768 r30, 1 row, forward", "hooks_us": res["hooks"].median * 1e6,
                 "no_hooks_us": res["no hooks"].median * 1e6,
                 "ratio": res["hooks"].median / res["no hooks"].median})
    layers = 2 if quick else 6
    _, step = _six_encoder(batch=1, layers=layers)
    _, plain_step = _six_encoder(batch=1, layers=layers, hooks=False)
    res = compare({"hooks": step, "no hooks": plain_step}, warmup=2, repeat=5 if quick else 11)
    rows.append({"benchmark": f"six-encoder eager AdamW step, 1 x 128, {layers} layers",
                 "hooks_ms": res["hooks"].median * 1e3, "no_hooks_ms": res["no hooks"].median * 1e3,
                 "ratio": res["hooks"].median / res["no hooks"].median})
    # What the backend's profile option costs when on: the compiled step with each TT layer's part compiled
    # on its own, against the default compile.
    batch = 1 if quick else 8
    _, split = _six_encoder(batch=batch, layers=layers, compiled=True)
    _, whole = _six_encoder(batch=batch, layers=layers, compiled=True, profile=False)
    res = compare({"profile": split, "default": whole}, warmup=3, repeat=5 if quick else 11)
    rows.append({"benchmark": f"six-encoder compiled AdamW step (cc.compile_step), {batch} x 128, {layers} layers, "
                              f"backend option profile on / off",
                 "profile_ms": res["profile"].median * 1e3, "default_ms": res["default"].median * 1e3,
                 "ratio": res["profile"].median / res["default"].median})
    return rows


def format_rows(rows: list[dict]) -> str:
    return format_flat_rows([{k: (f"{v:.3f}x" if k == "ratio" else v) for k, v in r.items()} for r in rows])
