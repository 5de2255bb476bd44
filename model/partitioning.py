"""The one table mapping the model's logical axis names onto a pod's device mesh.

Layout (Megatron-style tensor parallelism plus data parallelism):
  * batch is split over `data`;
  * attention heads, MLP hidden units and the vocabulary are split over `model`;
  * everything else (embed, per-head features, K/V heads, sequence length) is replicated.
Sequence parallelism (ModelConfig.sequence_parallel, Megatron-style): the activations that
tensor parallelism leaves replicated -- the residual stream and the norms, named with the
`residual_length` axis -- are split along the sequence over `model` instead. XLA then emits an
all-gather before the column-parallel matmuls (query/key/value, gate/up, logits) and a
reduce-scatter after the row-parallel ones (attention output, MLP down), where plain tensor
parallelism has an all-reduce. The model names the axis; `logical_rules(config)` decides.
K/V heads stay replicated: with multi-query attention there is a single K/V head, and
replicating it is what lets every `model` shard attend with its own query heads locally.

How to run model code sharded (the pattern the pod worker uses):

    mesh = make_mesh(data=2, model=2)
    p_shard = param_shardings(abstract_params(config), mesh)
    with activate_rules(mesh):
        step = jax.jit(fn, in_shardings=(p_shard, batch_sharding(mesh)), out_shardings=...)
        out = step(params, tokens)

`activate_rules` must be active while `jit` *traces* (the first call): the activation
constraints inside the model are resolved at trace time, and are silently no-ops when no
rules or no mesh are active (so plain single-device `apply` needs nothing).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "model")

_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("vocab", "model"),
    ("heads", "model"),
    ("mlp", "model"),
    ("kv_heads", None),
    ("embed", None),
    ("kv", None),
    ("length", None),
    ("residual_length", None),  # "model" under sequence parallelism
)


def logical_rules(config=None) -> tuple[tuple[str, str | None], ...]:
    """The (logical axis, mesh axis or None) rules for every name the model uses.

    `config` (a ModelConfig, optional) selects the variant: with `sequence_parallel` on, the
    sequence axis of the residual/norm activations maps to `model`. Parameters never use that
    axis, so their shardings are the same either way.
    """
    if config is not None and config.sequence_parallel:
        return tuple((name, "model") if name == "residual_length" else (name, axis)
                     for name, axis in _RULES)
    return _RULES


@contextlib.contextmanager
def rules_for(config) -> Iterator[None]:
    """Make `logical_rules(config)` the current Flax axis rules (the mesh is left as it is).

    The step programs enter this inside the traced function, so a pod's sequence-parallel
    switch takes effect wherever the program is traced under `activate_rules(mesh)`.
    """
    with nn.logical_axis_rules(logical_rules(config)):
        yield


def make_mesh(data: int, model: int, devices=None) -> Mesh:
    """A (data, model) mesh over the first data*model devices, with Auto (GSPMD) axes.

    Built with `Mesh` directly because `jax.make_mesh` now defaults to Explicit axes.
    """
    devices = jax.devices() if devices is None else list(devices)
    if data * model > len(devices):
        raise ValueError(f"mesh {data}x{model} needs {data * model} devices, have {len(devices)}")
    return Mesh(np.array(devices[: data * model]).reshape(data, model), MESH_AXES)


@contextlib.contextmanager
def activate_rules(mesh: Mesh, config=None) -> Iterator[None]:
    """Make `mesh` the current mesh and `logical_rules(config)` the current Flax axis rules.

    Both are needed for `nn.with_logical_constraint` to take effect. `jax.set_mesh` is
    used (not the deprecated `with mesh:`) because Flax looks the mesh up through
    `jax.sharding.get_abstract_mesh()`, which only `set_mesh` populates.
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(logical_rules(config)):
        yield


def _check_divisible(path, shape, spec: PartitionSpec, mesh: Mesh) -> None:
    """Fail early with the parameter's name rather than deep inside device_put."""
    for dim, axes in zip(shape, spec):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else axes
        ways = int(np.prod([mesh.shape[a] for a in axes]))
        if dim % ways:
            name = jax.tree_util.keystr(path)
            raise ValueError(f"param {name} shape {tuple(shape)}: dim {dim} is not divisible "
                             f"by mesh axes {axes} of size {ways}")


def param_shardings(abstract_params, mesh: Mesh):
    """NamedShardings for a param tree whose leaves are `nn.Partitioned` boxes.

    The result has the structure of the *unboxed* tree (as returned by `init_params`),
    so it can be used directly as jit in/out_shardings or with `jax.device_put`.
    """
    logical_specs = nn.get_partition_spec(abstract_params)
    shardings = nn.logical_to_mesh_sharding(logical_specs, mesh, _RULES)
    shapes = nn.unbox(abstract_params)
    jax.tree_util.tree_map_with_path(
        lambda path, leaf, sharding: _check_divisible(path, leaf.shape, sharding.spec, mesh),
        shapes, shardings)
    return shardings


def _sharding_for(mesh: Mesh, logical_axes: tuple[str, ...]) -> NamedSharding:
    spec = nn.logical_to_mesh_axes(logical_axes, _RULES)
    assert spec is not None     # None only for axis names None
    return NamedSharding(mesh, spec)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding for token arrays [batch, length]: batch split over `data`."""
    return _sharding_for(mesh, ("batch", "length"))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on `mesh` (scalars, metrics, RNG keys)."""
    return NamedSharding(mesh, PartitionSpec())
