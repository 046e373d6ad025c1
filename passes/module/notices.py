"""What tensorize says about the layers and weights it leaves dense: the warnings of a selection (tied groups,
layers no smaller as TT, subclasses with a forward of their own, frozen layers under init="random"), the
weights a model holds as plain Parameters that tensorize cannot rewrite (MoE experts stored as one 3-D
tensor, nn.MultiheadAttention's in_proj_weight, convolutions), and the warning for a call that rewrote
nothing.  select.py builds the selection; this module only words it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from comera_compile.layers import TTLayer
from comera_compile.passes.module.options import layer_kind

if TYPE_CHECKING:
    from comera_compile.passes.module.select import TensorizeSummary

__all__ = ["FROZEN", "nothing_rewritten", "kept_dense_warnings", "frozen_warning", "plain_weights",
           "plain_weights_warning"]

FROZEN = "frozen (requires_grad=False): init='random' would replace the values it holds with cores that never train"
PLAIN_SHARE = 0.1   # plain weights holding at least this share of the model's parameters are warned about


def frozen_warning(frozen: list[str]) -> str:
    """The warning for frozen layers kept dense under init="random"."""
    return (f"tensorize: kept {len(frozen)} frozen layer(s) dense ({'; '.join(frozen[:4])}"
            f"{'; ...' if len(frozen) > 4 else ''}): their weights do not train (requires_grad=False), and "
            f"init='random' would replace the values they hold (a fixed table, such as sinusoidal positions) "
            f"with random TT cores for good.  Pass init='svd' to factor their values instead.")


def plain_weights(model: nn.Module, min_features: int) -> dict[str, str]:
    """The weights of at least two dimensions, both largest at least min_features, that a module holds as a
    plain Parameter outside any layer tensorize rewrites (and outside TT layers), by qualified name, with
    what holds them: tensorize leaves them dense, and its summary says so."""
    inside: list[str] = []   # layers (and TT layers) whose own submodules hold their parameters
    out: dict[str, str] = {}
    for name, mod in model.named_modules():
        if any(name.startswith(p) for p in inside):
            continue
        if layer_kind(mod) is not None or isinstance(mod, TTLayer):
            inside.append(f"{name}." if name else "")
            continue
        for pname, p in mod.named_parameters(recurse=False):
            dims = sorted(p.shape)
            if p.dim() >= 2 and dims[-2] >= min_features:
                shape = "x".join(map(str, p.shape))
                out[f"{name}.{pname}" if name else pname] = (
                    f"a {shape} Parameter of {type(mod).__name__}, not a layer tensorize rewrites")
    return out


def plain_weights_warning(model: nn.Module, plain: dict[str, str]) -> str | None:
    """The warning for plain weights holding at least PLAIN_SHARE of the model's parameters, else None."""
    params = dict(model.named_parameters())
    held = sum(params[n].numel() for n in plain if n in params)
    total = sum(p.numel() for p in params.values())
    if not plain or total == 0 or held < PLAIN_SHARE * total:
        return None
    names = "; ".join(f"{n} ({r.split(' ')[1]})" for n, r in list(plain.items())[:4])
    return (f"tensorize: kept {len(plain)} weight(s) dense that modules hold as plain Parameters ({names}"
            f"{'; ...' if len(plain) > 4 else ''}): {held / total:.0%} of the model's {total:,} parameters.  "
            f"tensorize rewrites nn.Linear, nn.Embedding, nn.EmbeddingBag and transformers' Conv1D layers; "
            f"weights held otherwise (MoE experts stored as one 3-D tensor, nn.MultiheadAttention's "
            f"in_proj_weight) stay as they are.  comera_summary.kept_dense lists them.")


def nothing_rewritten(model: nn.Module, summary: TensorizeSummary) -> str:
    """The warning for a call that rewrites no layer: the model comes back dense, and the user should know."""
    if summary.kept_dense:
        reasons = "; ".join(f"{n}: {r}" for n, r in list(summary.kept_dense.items())[:3])
        more = "; ..." if len(summary.kept_dense) > 3 else ""
        return (f"tensorize: rewrote no layer; the model stays dense ({len(summary.kept_dense)} kept dense: "
                f"{reasons}{more}).  See the result's comera_summary; a smaller min_features or rank, or an "
                f"explicit shape, rewrites small layers.")
    tt = sum(isinstance(m, TTLayer) for m in model.modules())
    found = f"its {tt} TT layer(s) are tensorized already" if tt else (
        "it has no nn.Linear, nn.Embedding, nn.EmbeddingBag or transformers Conv1D")
    return f"tensorize: rewrote no layer of {type(model).__name__}: {found}."


def kept_dense_warnings(summary: TensorizeSummary, tied: str, tied_groups: list[str], grown: list[str],
                        bigger: list[str], custom: list[str]) -> list[str]:
    """The warnings a selection gives (tied groups, layers kept dense or grown by their TT form); records
    the untied groups in the summary."""
    out = []
    if tied_groups:
        groups = "; ".join(sorted(set(tied_groups)))
        if tied == "untie":
            summary.untied = sorted(set(tied_groups))
            out.append(f"tensorize: {groups} shared one weight and are now UNTIED: each tensorizable one "
                       f"got its own TT factorization (tied='untie').")
        else:
            out.append(f"tensorize: {groups} share one weight; left dense so they stay tied. Pass "
                       f"tied='untie' to tensorize them separately (they then train independently).")
    if grown:
        out.append(f"tensorize: kept {len(grown)} layer(s) dense: at the default rank their TT form would "
                   f"have no fewer parameters ({'; '.join(grown[:4])}{'; ...' if len(grown) > 4 else ''}). "
                   f"Pass a smaller rank to tensorize them.")
    if custom:
        out.append(f"tensorize: kept {len(custom)} layer(s) dense whose class has its own forward, or whose "
                   f"weight is not a plain parameter, which a TT layer would not compute "
                   f"({'; '.join(custom[:4])}{'; ...' if len(custom) > 4 else ''}).")
    if bigger:
        out.append(f"tensorize: {len(bigger)} layer(s) are no smaller as TT at the rank or shape asked for "
                   f"({'; '.join(bigger[:4])}{'; ...' if len(bigger) > 4 else ''}).")
    return out
