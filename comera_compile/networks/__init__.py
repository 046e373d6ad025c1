"""Tensor networks of TT products: their description, cost model, contraction-order search and execution.

network (what is contracted) <- cost (what a contraction costs) <- plan (a tree as executable steps)
<- order (the cheapest tree: search) <- segments (TT linear programs per row count) and lookup (TTM embedding
lookups) <- codegen (a TT linear layer's program as one generated function, what the layer runs).  Import
from here: `from comera_compile import networks as nw; nw.plan_tt_linear(spec, rows)`.
"""

from .cost import TRAFFIC_WEIGHT, contraction_cost, tree_cost
from .lookup import LOOKUP_HOWS, Group, LookupPlan, lookup_bucket, plan_ttm_lookup, ttm_lookup_program
from .network import (Network, TensorSpec, Tree, einsum_network, pairwise_flops, tt_linear_network,
                      ttm_embedding_network)
from .plan import (Contraction, Operand, Plan, Program, Recipe, Step, contract_pair, execute, fuses_bias,
                   plan_from_tree, run_program)
from .order import (EXACT_ALL_SUBSETS, EXACT_CONNECTED, TrainingPathOptimizer, greedy_tree, optimal_tree,
                     plan_tt_linear, reference_tree, search)
from .segments import MAX_SEGMENT_ROWS, tt_linear_program, tt_linear_segments

__all__ = [
    "TensorSpec", "Network", "Tree", "tt_linear_network", "ttm_embedding_network", "einsum_network",
    "pairwise_flops",
    "TRAFFIC_WEIGHT", "contraction_cost", "tree_cost",
    "Step", "Plan", "Operand", "Recipe", "Contraction", "Program", "plan_from_tree", "contract_pair",
    "fuses_bias", "run_program", "execute",
    "EXACT_ALL_SUBSETS", "EXACT_CONNECTED", "optimal_tree", "greedy_tree", "search", "reference_tree",
    "plan_tt_linear", "TrainingPathOptimizer",
    "MAX_SEGMENT_ROWS", "tt_linear_program", "tt_linear_segments",
    "LOOKUP_HOWS", "Group", "LookupPlan", "plan_ttm_lookup", "lookup_bucket", "ttm_lookup_program",
]
