"""Optimizer state carried through a gauge change: a gate multiplied by f keeps the optimizer state that
the same gradients, seen in the new scale, would have built (torch's optimizers, each with its own keys)."""

from __future__ import annotations

import copy

import pytest
import torch

from comera_compile.optim_state import replace, rescale, restart

# Optimizers whose per-element state is built from the gradients alone (no weight decay), so that the
# state a gradient history divided by f builds is the reference for the rescaled one.  Their eps, added to a
# gradient (Adamax) or to a root of its square (RMSprop), is set where it does not blur the comparison.
GRADIENT_STATE = {
    "Adam": (torch.optim.Adam, {}),
    "AdamW-amsgrad": (torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.0}),
    "Adamax": (torch.optim.Adamax, {"eps": 1e-30}),
    "NAdam": (torch.optim.NAdam, {}),
    "RAdam": (torch.optim.RAdam, {}),
    "Adagrad": (torch.optim.Adagrad, {}),
    "RMSprop-momentum-centered": (torch.optim.RMSprop, {"momentum": 0.9, "centered": True, "eps": 1e-30}),
    "SGD-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "Adafactor": (getattr(torch.optim, "Adafactor", None), {}),
}


def _stepped(cls: type, kwargs: dict, start: torch.Tensor, grads: list[torch.Tensor]) -> tuple:
    p = torch.nn.Parameter(start.clone())
    opt = cls([p], lr=1e-3, **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p, opt


@pytest.mark.parametrize("name", sorted(GRADIENT_STATE))
def test_a_rescaled_gate_s_state_is_the_one_its_gradients_in_the_new_scale_build(name):
    cls, kwargs = GRADIENT_STATE[name]
    if cls is None:
        pytest.skip("this torch has no Adafactor")
    torch.manual_seed(0)
    gate = torch.rand(6, dtype=torch.float64) + 0.5
    grads = [torch.randn(6, dtype=torch.float64) for _ in range(5)]
    f = torch.tensor([0.01, 0.5, 1.0, 3.0, 40.0, 1000.0], dtype=torch.float64)

    p, opt = _stepped(cls, kwargs, gate, grads)
    # Reference: the gate in the new scale, fed the gradients it would have had there (1/f the old ones).
    _, ref = _stepped(cls, kwargs, gate * f, [g / f for g in grads])
    replace(opt, [(p, p)], rescale({id(p): f}, opt))

    got, want = opt.state[p], next(iter(ref.state.values()))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-12, msg=f"{name}'s {key}")


def test_rprop_steps_on_a_rescaled_gate_as_on_the_old_one_times_f():
    """Rprop's step sizes are in the parameter's units: carried into the new scale, the steps after the
    gauge change are f times the steps the old scale would have taken (its updates are scale-equivariant)."""
    torch.manual_seed(0)
    target = torch.randn(5, dtype=torch.float64)
    f = torch.tensor([0.1, 0.5, 2.0, 4.0, 8.0], dtype=torch.float64)
    p = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    opt = torch.optim.Rprop([p], lr=0.01)

    def step(param, optimizer, scale):
        optimizer.zero_grad()
        ((param / scale - target) ** 2 * torch.arange(1.0, 6.0, dtype=torch.float64)).sum().backward()
        optimizer.step()

    for _ in range(4):
        step(p, opt, torch.ones(5, dtype=torch.float64))
    q = torch.nn.Parameter(p.detach() * f)
    scaled = torch.optim.Rprop([q], lr=0.01)
    scaled.load_state_dict(copy.deepcopy(opt.state_dict()))   # loading keeps the tensors
    replace(scaled, [(q, q)], rescale({id(q): f}, scaled))
    for _ in range(4):
        step(p, opt, torch.ones(5, dtype=torch.float64))
        step(q, scaled, f)
    torch.testing.assert_close(q.detach(), p.detach() * f, rtol=1e-10, atol=1e-12)


def test_a_rounding_keeps_adafactor_s_gate_variance_on_its_bond_s_average():
    """A rounding rotates a gate's slices: its squared-gradient average (Adafactor's `variance`) is spread
    evenly over them, not zeroed (a zero variance with the step count kept makes the next update huge)."""
    adafactor = getattr(torch.optim, "Adafactor", None)
    if adafactor is None:
        pytest.skip("this torch has no Adafactor")
    torch.manual_seed(0)
    gate = torch.nn.Parameter(torch.rand(4) + 0.5)
    opt = adafactor([gate])
    for _ in range(3):
        gate.grad = torch.randn(4)
        opt.step()
    before = opt.state[gate]["variance"].clone()
    replace(opt, [(gate, gate)], restart)
    torch.testing.assert_close(opt.state[gate]["variance"], before.mean().expand(4))


@pytest.mark.parametrize("foreach", [False, True])
def test_a_rounded_core_under_nadam_steps_as_under_a_fresh_nadam(foreach):
    """A rounding restarts a core's Adam-family state from nothing: under NAdam that includes its momentum
    product (which after 300 steps has fallen to 0 and would shrink the next updates to 0.56x, 0.81x, ...):
    the next three updates are a fresh NAdam's on the same parameter and gradients."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 4, 8))
    opt = torch.optim.NAdam([p], lr=1e-2, foreach=foreach)
    for _ in range(300):
        p.grad = torch.randn_like(p)
        opt.step()
    replace(opt, [(p, p)], restart)
    q = torch.nn.Parameter(p.detach().clone())
    fresh = torch.optim.NAdam([q], lr=1e-2, foreach=foreach)
    for _ in range(3):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        fresh.step()
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_rounding_keeps_rprop_s_step_sizes_and_asgd_s_average_in_the_new_basis():
    """Rprop's per-entry step sizes are magnitudes, averaged over the rotated axes like second moments (zeroed,
    the next update was step_size_min, 1e-6, for about 50 steps); ASGD's average of the parameter becomes the
    rotated parameter (zeroed, it was 4.1 off where the parameter is)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3, 4, 5))
    rprop = torch.optim.Rprop([p], lr=1e-2)
    for _ in range(20):
        p.grad = torch.randn_like(p)
        rprop.step()
    sizes = rprop.state[p]["step_size"].clone()
    replace(rprop, [(p, p)], restart)
    after = rprop.state[p]["step_size"]
    torch.testing.assert_close(after, sizes.mean((0, 2), keepdim=True).expand_as(sizes))
    assert float(after.min()) > 1e-4
    a = torch.nn.Parameter(torch.randn(3, 4, 5))
    asgd = torch.optim.ASGD([a], lr=1e-2)
    for _ in range(5):
        a.grad = torch.randn_like(a)
        asgd.step()
    with torch.no_grad():
        a.mul_(-1.0)   # the rounding rotated it
    replace(asgd, [(a, a)], restart)
    assert torch.equal(asgd.state[a]["ax"], a.detach())


@pytest.mark.parametrize("name", sorted(GRADIENT_STATE))
def test_rescale_all_of_many_gates_gives_each_the_state_rescale_gives_it(name):
    """rescale_all (every gate's state entry of one kind in one concatenated operation, as RankAdaptive's
    re-balancing uses it) leaves each of several gates of different lengths and dtypes the state that rescale
    gives it alone."""
    from comera_compile.optim_state import rescale_all

    cls, kwargs = GRADIENT_STATE[name]
    if cls is None:
        pytest.skip("this torch has no Adafactor")
    torch.manual_seed(0)
    sizes, dtypes = (6, 3, 9, 1), (torch.float32, torch.float64, torch.float32, torch.float32)
    gates = [torch.nn.Parameter(torch.rand(n, dtype=dt) + 0.5) for n, dt in zip(sizes, dtypes)]
    opt = cls(gates, lr=1e-3, **kwargs)
    for _ in range(3):
        for g in gates:
            g.grad = torch.randn_like(g)
        opt.step()
    factors = {id(g): torch.rand(g.numel(), dtype=torch.float64) * 4 + 0.1 for g in gates}
    alone = copy.deepcopy(opt.state_dict())
    rescale_all(opt, gates, factors)
    ref = cls([torch.nn.Parameter(g.detach().clone()) for g in gates], lr=1e-3, **kwargs)
    ref.load_state_dict(alone)
    for g, r in zip(gates, ref.param_groups[0]["params"]):
        replace(ref, [(r, r)], rescale({id(r): factors[id(g)]}, ref))
        for key, value in ref.state[r].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(opt.state[g][key], value), f"{name}'s {key}"


RESTARTED = {**GRADIENT_STATE, "Rprop": (torch.optim.Rprop, {}), "ASGD": (torch.optim.ASGD, {}),
             "Adadelta": (torch.optim.Adadelta, {})}


@pytest.mark.parametrize("name", sorted(RESTARTED))
def test_restart_all_of_many_cores_and_gates_gives_each_the_state_restart_gives_it(name):
    """restart_all (each kind of change batched over all parameters, as RankAdaptive's check rounds every
    layer at once) leaves each core and gate, of several shapes and dtypes, the state restart gives it alone."""
    from comera_compile.optim_state import restart_all

    cls, kwargs = RESTARTED[name]
    if cls is None:
        pytest.skip("this torch has no Adafactor")
    torch.manual_seed(0)
    shapes = [(1, 4, 3), (3, 4, 1), (1, 4, 3), (3, 2, 2, 1), (3,), (3,), (5,)]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float32, torch.float32, torch.float64, torch.float32]
    params = [torch.nn.Parameter(torch.randn(s, dtype=dt)) for s, dt in zip(shapes, dtypes)]
    opt = cls(params, lr=1e-3, **kwargs)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    with torch.no_grad():
        for p in params:
            p.mul_(-1.0)   # the rounding rotated them (ASGD's average becomes the parameter)
    saved, ref = copy.deepcopy(opt.state_dict()), copy.deepcopy(opt)   # the copy's parameters: its own
    restart_all(opt, params)
    changed = 0
    for i, (p, r) in enumerate(zip(params, ref.param_groups[0]["params"])):
        replace(ref, [(r, r)], restart)
        assert set(opt.state[p]) == set(ref.state[r])
        for key, value in ref.state[r].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(opt.state[p][key], value, rtol=1e-6, atol=0, msg=f"{name}'s {key}")
                before = saved["state"][i][key]
                changed += int(not torch.equal(before, value))
            else:
                assert opt.state[p][key] == value, f"{name}'s {key}"
    assert changed > 0   # the restart did something to compare
