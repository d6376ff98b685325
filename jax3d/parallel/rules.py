"""Logical axis names -> mesh axes: the one table that expresses tensor, sequence and pipeline parallelism.

Model code names logical axes only. Megatron's split falls out of the table: `heads` and `mlp` on `model`
make QKV / MLP-up column-parallel and attention-out / MLP-down row-parallel; `vocab` on `model` makes the
embedding and the LM head vocab-parallel; `layers` on `stage` hands each stage its slice of blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import PartitionSpec as P

# (logical, mesh axis or None). `act_seq` is the sequence dim of the residual stream between blocks,
# where layer norm and dropout run; sequence parallelism shards it on `model`.
BASE_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("layers", "stage"),
    ("vocab", "model"),
    ("heads", "model"),
    ("mlp", "model"),
    ("embed", None),
    ("kv", None),
    ("seq", None),
    ("act_seq", None),
    ("pos", None),
    ("norm", None),
    ("qkv", None),
    ("types", None),
    ("classes", None),
)


@dataclass(frozen=True)
class ShardingRules:
    """A hashable logical-to-mesh table. `constrain` is a no-op when `active` is False (no mesh)."""

    table: tuple[tuple[str, str | None], ...] = BASE_RULES
    active: bool = True

    @classmethod
    def create(cls, sequence_parallel: bool = False) -> "ShardingRules":
        table = dict(BASE_RULES)
        if sequence_parallel:
            table["act_seq"] = "model"
        return cls(tuple(table.items()))

    @classmethod
    def inactive(cls) -> "ShardingRules":
        return cls(BASE_RULES, active=False)

    def without(self, *mesh_axes: str) -> "ShardingRules":
        """The table with some mesh axes dropped, for code that runs inside a shard_map manual over them."""
        return ShardingRules(tuple((k, None if v in mesh_axes else v) for k, v in self.table), self.active)

    def splits(self, logical: str) -> bool:
        """Whether the table puts a logical axis on a mesh axis (`act_seq` does under sequence parallelism)."""
        return self.active and dict(self.table).get(logical) is not None

    def spec(self, logical: tuple[str | None, ...]) -> P:
        table = dict(self.table)
        out, used = [], set()
        for name in logical:
            if name is not None and name not in table:
                raise KeyError(f"logical axis {name!r} has no sharding rule")
            axis = table.get(name) if name is not None else None
            if axis is not None:
                if axis in used:
                    raise ValueError(f"logical axes {logical} put mesh axis {axis!r} on two dims of one array")
                used.add(axis)
            out.append(axis)
        return P(*out)

    def constrain(self, x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
        mesh = jax.sharding.get_abstract_mesh()
        if not self.active or mesh.empty:
            return x  # no mesh in context: plain single-device code
        spec = self.spec(logical)
        # Inside a shard_map (the pipeline is manual over `stage` and `data`) only Auto axes may be named.
        manual = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual}
        if manual:
            spec = P(*(None if a in manual else a for a in spec))
        return jax.lax.with_sharding_constraint(x, spec)


# The table as a module's default (Megatron's table; with no mesh in context, no constraint).
DEFAULT_RULES = ShardingRules()


def tree_specs(rules: ShardingRules, logical_tree) -> object:
    """Maps a pytree of logical-axis tuples to PartitionSpecs."""
    return jax.tree.map(rules.spec, logical_tree, is_leaf=lambda x: isinstance(x, tuple))


def named_shardings(mesh, spec_tree) -> object:
    """Maps a pytree of PartitionSpecs to NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), spec_tree,
                        is_leaf=lambda x: isinstance(x, P))


def with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs of `abstract_tree` carrying `shardings`: a tree to compile against, or to
    restore a checkpoint onto (orbax reads each slice straight onto its device), without allocating it."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)


def constrain_tree(tree, spec_tree):
    """`with_sharding_constraint` on every leaf of `tree`, with the matching PartitionSpec of `spec_tree`."""
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, spec_tree)
