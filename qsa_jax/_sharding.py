"""Multi-device use of qsa_jax: inside ``jax.shard_map``, never across devices under plain ``jax.jit``.

Every qsa_jax call runs on one device's arrays: a Triton kernel (GPU,
jax-triton's custom call) or the interpreter (CPU, ``jax.pure_callback``).
Over several devices they belong inside ``jax.shard_map``, where each device
runs the call on its own shard (KV heads and their query heads, or rows /
requests with one pager per device): see ``docs/scaling-out.md``.

Under plain ``jax.jit`` over arrays placed on several devices (a
``NamedSharding``), XLA's partitioner would have to split the call itself.
It cannot do that right today, so such a call raises :data:`ERROR` instead:

* a custom call without a sharding rule (the GPU path) is replicated by
  Shardy's default (not checked here without GPUs): every device would
  gather every head and run the whole kernel -- right, but it does not
  scale and moves the caches every step;
* a ``pure_callback`` (the CPU path) is pinned to the mesh's first device
  ({maximal device=0}); a jit whose result is such a value hands back an
  array that the next jit rejects (``TypeError: Cannot convert GSPMDSharding
  {maximal device=0} into SdyArray``);
* a ``jax.experimental.custom_partitioning`` rule (Shardy ``sharding_rule``)
  with the per-shard call as its ``lower_fn`` crashed the process
  (segmentation fault, jax 0.10.2, 2 host devices) as soon as the per-shard
  body held a ``pure_callback`` (host callbacks lowered inside the
  partitioner are not kept alive: jax-ml/jax pull request 23620); it could
  only serve the GPU path, which cannot be checked without GPUs, and a split
  by requests needs one pager per device, which no sharding rule can derive.

The check is made while lowering, from the lowering context alone (how many
devices the computation spans and which mesh axes are manual): nothing is
added to the compiled program and nothing runs per call.  Eager calls on
arrays that span several devices fail the same way.
"""

from __future__ import annotations

import math

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

__all__ = ["guard", "ERROR"]

#: Raised (as ValueError) for a call partitioned across devices outside shard_map.
ERROR = ("{function}: its arrays span {devices} devices outside jax.shard_map. qsa_jax kernels run on one "
         "device's arrays and XLA cannot partition them: call it inside jax.shard_map over your mesh "
         "(KV heads and their query heads split, index caches and metadata replicated; or rows split) "
         "-- see docs/scaling-out.md")


def _spanned_devices(axis_context) -> int:
    """Devices one instance of the call would span in this lowering context (1 inside a full shard_map).

    Read from the context's public attributes, whatever its class (JAX names no public type for it):
    inside ``shard_map`` it has a ``mesh`` and ``manual_axes`` (the mesh's other axes are still
    partitioned automatically); under plain ``jit`` it has ``num_devices``."""
    manual = getattr(axis_context, "manual_axes", None)
    mesh = getattr(axis_context, "mesh", None)
    if manual is not None and mesh is not None:  # inside shard_map (maybe partly manual)
        return math.prod(size for name, size in mesh.shape.items() if name not in manual)
    devices = getattr(axis_context, "num_devices", None)
    return devices if isinstance(devices, int) else 1  # anything else (a future context): left to the runtime


def _check_arrays(function: str, values) -> None:
    for value in values:
        if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
            devices = len(value.sharding.device_set)
            if devices > 1:
                raise ValueError(ERROR.format(function=function, devices=devices))


_guard_p = Primitive("qsa_single_device_guard")
_guard_p.multiple_results = True


def _impl(*values, function):
    _check_arrays(function, values)
    return values


def _lowering(ctx, *values, function):
    devices = _spanned_devices(ctx.module_context.axis_context)
    if devices > 1:
        raise ValueError(ERROR.format(function=function, devices=devices))
    return values  # no operation: the operands are the results


_guard_p.def_impl(_impl)
_guard_p.def_abstract_eval(lambda *avals, function: avals)
mlir.register_lowering(_guard_p, _lowering)


def guard(function: str, values) -> tuple:
    """``values`` unchanged; raises :data:`ERROR` when lowered (or run) across several devices.

    The adapters' launch path passes every call's arrays through it.
    """
    return tuple(_guard_p.bind(*values, function=function))
