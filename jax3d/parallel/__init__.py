"""Logical-to-mesh sharding rules and ZeRO transforms."""
from jax3d.sharding.rules import BASE_RULES, ShardingRules, constrain_tree, named_shardings, tree_specs, with_shardings
from jax3d.sharding.zero import add_data_axis, cast_for_compute, state_specs, zero_specs

__all__ = ["BASE_RULES", "ShardingRules", "constrain_tree", "named_shardings", "tree_specs", "with_shardings", "add_data_axis",
           "cast_for_compute", "state_specs", "zero_specs"]
