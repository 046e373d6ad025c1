"""TT layers that read the same input, contracted together: fewer and larger GEMMs.

Attention's q, k and v projections read one activation, and so do an MLP's gate and up projections.
Tensorized, each starts with a GEMM of that activation against a matrix made from its own cores
(``x @ L_i``), then multiplies the result by a second core-made matrix (``(x @ L_i) @ R_i``).  On a GPU
these are small GEMMs whose launch and tail cost as much as their arithmetic (docs/method.md, section 7).
``batch_siblings(gm)`` rewrites dynamo's graph, in place:

- matmuls of one activation (the same node, reached through the same reshapes and permutations) by 2-D
  right-hand sides become one matmul against the right-hand sides side by side (``x @ [L_1 ... L_G]``),
  whose column blocks replace the products; the backward then computes x's gradient and the cores'
  in one GEMM each instead of G;
- where each of those column blocks, all of one width, is then multiplied by a right-hand side of one
  shape (with or without a bias), the G products become one batched GEMM over a view of the first result;
- the products of the cores of every TT layer of one plan (attention's four projections, the same
  layer in each block of a graph), position by position, become one batched matmul each.

Values are unchanged (the same products, grouped); only pure computations of the right-hand sides move
earlier in the graph, never across a change of grad mode or autocast, an in-place op or a module call.
Products with a symbolic size (a dynamic row count), and nodes without recorded fake values, are left alone.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable, Sequence

import torch
import torch.fx

from comera_compile.layers import TTLayer
from comera_compile.logs import _owner
from comera_compile.passes import (GraphPassResult, calls_in_place, ensure_values, lifted_tensor, node_shape,
                                   node_value)

__all__ = ["batch_siblings"]

_MATMULS = (torch.matmul, operator.matmul)
_VIEW_METHODS = ("reshape", "view", "contiguous")
_QUIET = (torch._C._log_api_usage_once,)


def _static_shape(node: object) -> tuple[int, ...] | None:
    shape = node_shape(node)   # None where a size is symbolic: such graphs are left alone
    return shape if shape is not None and all(type(s) is int for s in shape) else None


def _is_view(node: torch.fx.Node) -> bool:
    return ((node.op == "call_method" and node.target in _VIEW_METHODS)
            or (node.op == "call_function" and node.target is torch.reshape))


def _layout_step(node: torch.fx.Node) -> tuple | None:
    """A reshape or permutation of one tensor as (kind, constant): ("shape", shape) or ("permute", dims)."""
    if _is_view(node):
        shape = _static_shape(node)
        return None if shape is None else ("shape", shape)
    if node.op == "call_method" and node.target in ("permute", "transpose") or (
            node.op == "call_function" and node.target in (torch.permute, torch.transpose)):
        rest = node.args[1:]
        if node.kwargs or not all(isinstance(a, (int, tuple, list)) for a in rest):
            return None
        flat = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else tuple(rest)
        return (str(node.target if isinstance(node.target, str) else node.target.__name__), flat)
    return None


def _source(node: torch.fx.Node) -> tuple[torch.fx.Node, tuple]:
    """The tensor a chain of reshapes and permutations starts from, and the chain as constants (runs of
    reshapes as their last shape): two chains with equal keys from one tensor compute equal values."""
    steps = []
    while isinstance(node.args[0] if node.args else None, torch.fx.Node) and (step := _layout_step(node)):
        steps.append(step)
        node = node.args[0]
    key: list[tuple] = []
    for step in reversed(steps):
        if key and step[0] == "shape" and key[-1][0] == "shape":
            key[-1] = step
        else:
            key.append(step)
    return node, tuple(key)


def _product(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None] | None:
    """(left, right, bias) of a 2-D matmul or addmm with static shapes; None for anything else."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target in _MATMULS and len(node.args) == 2:
        (a, b), bias = node.args, None
    elif node.target is torch.addmm and len(node.args) == 3:
        bias, a, b = node.args
    else:
        return None
    if not all(isinstance(n, torch.fx.Node) for n in (a, b)):
        return None
    sa, sb = _static_shape(a), _static_shape(b)
    if sa is None or sb is None or len(sa) != 2 or len(sb) != 2 or sa[1] != sb[0]:
        return None
    if bias is not None and (_static_shape(bias) != (sb[1],)):
        return None
    return a, b, bias


def _is_boundary(node: torch.fx.Node) -> bool:
    """A node nothing may move across: a grad-mode or autocast switch, an assertion, an in-place op, a
    module call."""
    if node.op == "call_module":   # a module dynamo did not inline may change any state
        return True
    if node.op not in ("call_function", "call_method") or node.target in _QUIET:
        return False
    return node.is_impure() or calls_in_place(node)


class _Graph:
    """The graph's order and its segments between boundaries, kept while nodes move."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.renumber()

    def renumber(self) -> None:
        self.order: dict[torch.fx.Node, int] = {}
        self.segment: dict[torch.fx.Node, int] = {}
        seg = 0
        for i, node in enumerate(self.graph.nodes):
            if _is_boundary(node):
                seg += 1
            self.order[node] = i
            self.segment[node] = seg

    def hoist(self, needed: Iterable[torch.fx.Node], before: torch.fx.Node, forbidden: set[torch.fx.Node]) -> bool:
        """Move the pure computations `needed` depends on that come after `before` to just before it, in
        their order; False (nothing moved) where one is forbidden, impure or in another segment."""
        cone: set[torch.fx.Node] = set()
        stack = [n for n in needed if self.order[n] > self.order[before]]
        while stack:
            node = stack.pop()
            if node in cone:
                continue
            if (node in forbidden or node.op not in ("get_attr", "call_function", "call_method")
                    or _is_boundary(node) or self.segment[node] != self.segment[before]):
                return False
            cone.add(node)
            stack.extend(n for n in node.all_input_nodes if self.order[n] > self.order[before])
        for node in sorted(cone, key=self.order.__getitem__):
            before.prepend(node)
        if cone:
            self.renumber()
        return True


def _emit(g: _Graph, fn: Any, args: tuple, meta_from: torch.fx.Node) -> torch.fx.Node:
    """A new call of fn, its fake value computed (dynamo's graphs carry one on every node) and its source
    taken from meta_from."""
    node = g.graph.call_function(fn, args)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in meta_from.meta:
            node.meta[key] = meta_from.meta[key]
    values = torch.fx.node.map_arg(args, node_value)   # the fake values, through lists and tuples
    modes = {getattr(v, "fake_mode", None) for v in torch.utils._pytree.tree_leaves(values)
             if isinstance(v, torch.Tensor)}
    if len(modes) == 1 and None not in modes:
        with modes.pop():
            node.meta["example_value"] = fn(*values)
    return node


def _erase_dead(g: _Graph, nodes: Sequence[torch.fx.Node]) -> None:
    """Erase the nodes no one reads any more, and then their inputs that no one reads."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if (getattr(node, "_erased", False) or node.users or node.op in ("placeholder", "output")
                or _is_boundary(node)):
            continue
        inputs = node.all_input_nodes
        g.graph.erase_node(node)
        stack.extend(inputs)


def _replace(g: _Graph, products: Sequence[torch.fx.Node], outputs: Sequence[torch.fx.Node]) -> None:
    """Each product's uses now read its output; the products, and what only they read, erased."""
    for product, output in zip(products, outputs):
        inputs = product.all_input_nodes
        product.replace_all_uses_with(output)
        g.graph.erase_node(product)
        _erase_dead(g, inputs)
    g.renumber()


def _share_left(g: _Graph, members: list[torch.fx.Node]) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """One matmul of the members' common left side by their right sides side by side; its column blocks
    replace the members.  None (graph unchanged) where the right sides cannot all be computed first."""
    members = sorted(members, key=g.order.__getitem__)
    first = members[0]
    left = first.args[0]
    rights = [m.args[1] for m in members]
    if any(g.segment[m] != g.segment[first] for m in members) or not g.hoist(rights, first, set(members)):
        return None
    with g.graph.inserting_before(first):
        side_by_side = _emit(g, torch.cat, (rights, 1), first)
        product = _emit(g, torch.matmul, (left, side_by_side), first)
        blocks, offset = [], 0
        for member, right in zip(members, rights):
            width = _static_shape(right)[1]
            blocks.append(_emit(g, operator.getitem, (product, (slice(None), slice(offset, offset + width))), member))
            offset += width
    _replace(g, members, blocks)
    return product, blocks


def _next_products(blocks: list[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """The product each column block feeds as its left side (through reshapes that are its only users)."""
    products = []
    for block in blocks:
        node = block
        while len(node.users) == 1 and _is_view(next(iter(node.users))):
            node = next(iter(node.users))
        users = list(node.users)
        if len(users) != 1:
            return None
        product = _product(users[0])
        if product is None or product[0] is not node or _static_shape(node) != _static_shape(block):
            return None
        products.append(users[0])
    return products


def _batch_next(g: _Graph, first_product: torch.fx.Node, blocks: list[torch.fx.Node]) -> int:
    """The blocks' next products as batched GEMMs over (n, rows, width) views of the first product, one per
    run of adjacent blocks whose products agree in shape (k and v apart from q where k and v are narrower);
    how many batched GEMMs replaced products."""
    products = _next_products(blocks)
    if products is None:
        return 0
    kinds = [_next_kind(b, p) for b, p in zip(blocks, products)]
    starts = [sum(_static_shape(b)[1] for b in blocks[:i]) for i in range(len(blocks))]   # their first columns
    count, run = 0, [0]
    for i in range(1, len(blocks) + 1):
        if i < len(blocks) and kinds[i] == kinds[run[0]]:
            run.append(i)
            continue
        if len(run) > 1:
            count += _batch_run(g, first_product, starts[run[0]], [blocks[j] for j in run], [products[j] for j in run])
        run = [i]
    return count


def _next_kind(block: torch.fx.Node, product: torch.fx.Node) -> tuple:
    _, right, bias = _product(product)
    return (_static_shape(block), _static_shape(right), node_value(right).dtype,
            None if bias is None else node_value(bias).dtype)


def _batch_run(g: _Graph, first_product: torch.fx.Node, start: int, blocks: list[torch.fx.Node],
               products: list[torch.fx.Node]) -> int:
    """Adjacent blocks from column `start` on, of one width, and their next products, as one batched GEMM."""
    rows, width = _static_shape(blocks[0])
    parts = [_product(p) for p in products]
    rights = [r for _, r, _ in parts]
    biases = [b for _, _, b in parts]
    first = min(products, key=g.order.__getitem__)   # products stay in the blocks' (column) order
    needed = rights + [b for b in biases if b is not None]
    if any(g.segment[p] != g.segment[first] for p in products) or not g.hoist(needed, first, set(products)):
        return 0
    with g.graph.inserting_before(first):
        columns = _emit(g, operator.getitem, (first_product, (slice(None), slice(start, start + len(blocks) * width))),
                        first)
        view = _emit(g, torch.reshape, (columns, (rows, len(blocks), width)), first)
        left = _emit(g, torch.permute, (view, (1, 0, 2)), first)
        stacked = _emit(g, torch.stack, (rights,), first)
        if biases[0] is None:
            batched = _emit(g, torch.bmm, (left, stacked), first)
        else:
            bias = _emit(g, torch.unsqueeze, (_emit(g, torch.stack, (biases,), first), 1), first)
            batched = _emit(g, torch.baddbmm, (bias, left, stacked), first)
        outputs = [_emit(g, operator.getitem, (batched, i), p) for i, p in enumerate(products)]
    _replace(g, products, outputs)
    return 1


def _is_state(node: torch.fx.Node) -> bool:
    """A parameter (dynamo records the tensor a placeholder lifted; without that record: an activation)."""
    return node.op == "get_attr" or isinstance(lifted_tensor(node), torch.nn.Parameter)


def _core_products(g: _Graph) -> dict[str, list[torch.fx.Node]]:
    """Each TT layer's matmuls that no activation reaches (the products of its cores), in graph order."""
    moving: set[torch.fx.Node] = set()
    products: dict[str, list[torch.fx.Node]] = {}
    for node in g.graph.nodes:
        if (node.op == "placeholder" and not _is_state(node)) or any(n in moving for n in node.all_input_nodes):
            moving.add(node)
            continue
        if node.op != "call_function" or node.target not in _MATMULS or len(node.args) != 2 or node.kwargs:
            continue
        owner = _owner(node, TTLayer)
        if owner is not None:
            products.setdefault(owner[0], []).append(node)
    return products


def _stack(g: _Graph, parts: list[torch.fx.Node], meta_from: torch.fx.Node) -> torch.fx.Node:
    """torch.stack(parts); a reshape instead where part i is a reshape of batched[i] for one batched result
    (a chain of batched products then stays batched, with no copy between its steps)."""
    sources = []
    for i, part in enumerate(parts):
        node = part
        while _is_view(node):
            node = node.args[0]
        if not (node.op == "call_function" and node.target is operator.getitem and node.args[1] == i):
            break
        sources.append(node.args[0])
    shape = _static_shape(parts[0])
    if (len(sources) == len(parts) and len(set(sources)) == 1 and shape is not None
            and _static_shape(sources[0]) is not None and _static_shape(sources[0])[0] == len(parts)
            and all(_static_shape(p) == shape for p in parts)):
        return _emit(g, torch.reshape, (sources[0], (len(parts), *shape)), meta_from)
    return _emit(g, torch.stack, (parts,), meta_from)


def _operand_kinds(product: torch.fx.Node) -> tuple | None:
    kinds = tuple((_static_shape(a), getattr(node_value(a), "dtype", None)) for a in product.args)
    return None if any(shape is None or len(shape) < 2 for shape, _ in kinds) else kinds


def _batch_cores(g: _Graph) -> int:
    """The core products of TT layers whose plans agree in every shape (q, k, v and the output projection
    of attention; the same layer of every block in a graph of several), position by position, as one batched
    matmul each over stacked operands; how many sets of layers share them."""
    alike: dict[tuple, list[list[torch.fx.Node]]] = {}
    for products in _core_products(g).values():
        kinds = tuple(_operand_kinds(p) for p in products)
        if None not in kinds:   # the segment too: products across a boundary cannot move to one place
            alike.setdefault((kinds, g.segment[products[0]]), []).append(products)
    count = 0
    for same in alike.values():
        shared = False
        for batch in zip(*same) if len(same) > 1 else ():
            first = min(batch, key=g.order.__getitem__)
            operands = [a for p in batch for a in p.args]
            if any(g.segment[p] != g.segment[first] for p in batch) or not g.hoist(operands, first, set(batch)):
                continue
            with g.graph.inserting_before(first):
                lefts = _stack(g, [p.args[0] for p in batch], first)
                rights = _stack(g, [p.args[1] for p in batch], first)
                batched = _emit(g, torch.matmul, (lefts, rights), first)
                outputs = [_emit(g, operator.getitem, (batched, i), p) for i, p in enumerate(batch)]
            _replace(g, batch, outputs)
            shared = True
        count += shared
    return count


def _groups(nodes: Sequence[torch.fx.Node]) -> dict[tuple, list[torch.fx.Node]]:
    """The plain 2-D matmuls among nodes, grouped by their left side (its source and layout) and dtypes."""
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for node in nodes:
        product = _product(node)
        if product is None or product[2] is not None:
            continue
        left, right, _ = product
        lv, rv = node_value(left), node_value(right)
        groups.setdefault((*_source(left), _static_shape(left), lv.dtype, rv.dtype, lv.device), []).append(node)
    return groups


def batch_siblings(gm: torch.fx.GraphModule, example_inputs: Sequence[object] | None = None) -> GraphPassResult:
    """Contract products of one activation together, and alike layers' core products (module docstring), in
    place; the count is how many groups share: siblings reading one activation, and sets of alike layers.
    Reads the fake values dynamo records; a torch.fx trace gets them from example_inputs (without either it
    warns and rewrites nothing)."""
    if not ensure_values(gm, example_inputs, "batch_siblings"):
        return GraphPassResult(gm, 0)
    g = _Graph(gm)
    count = 0
    for members in _groups(list(gm.graph.nodes)).values():
        # an earlier group's rewrite may have erased or rewired a member (layers sharing cores): group anew
        for members in _groups([m for m in members if not getattr(m, "_erased", False)]).values():
            if len(members) < 2:
                continue
            shared = _share_left(g, members)
            if shared is None:
                continue
            count += 1
            _batch_next(g, *shared)
    count += _batch_cores(g)
    if count:
        gm.graph.lint()
        gm.recompile()
    return GraphPassResult(gm, count)
