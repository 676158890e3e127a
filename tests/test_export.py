"""What ``jax.export`` does with a jitted ``qsa_jax`` function (docs/api.md, "Exporting with jax.export").

On the CPU path the kernels run from a host callback, which JAX cannot
serialise: export fails with JAX's own ``NotImplementedError``.  On a GPU the
function exports once the custom-call safety check is lifted for
``qsa_jax.CUSTOM_CALL_TARGETS`` (jax-triton's two targets), and the deserialised artifact computes
the same bits as the jitted function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qsa_jax
from qsa_kernels import runtime


def _top4():
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.standard_normal((3, 48)), jnp.float32)
    visible = jnp.array([48, 9, 2], jnp.int32)
    return jax.jit(lambda logits, visible: qsa_jax.topk_blocks(logits, visible, 4)), (logits, visible)


@pytest.mark.skipif(not runtime.INTERPRETED, reason="the CPU path (interpreter from a host callback)")
def test_export_on_the_cpu_path_fails_because_host_callbacks_do_not_serialise():
    top4, args = _top4()
    expected = np.asarray(top4(*args))  # the jitted function itself works
    assert expected[2].tolist() == [0, 1, -1, -1]
    with pytest.raises(NotImplementedError, match="serialization of host_callbacks is not yet implemented"):
        jax.export.export(top4)(*args)
    # Lifting the custom-call check does not help: the callback is not a custom call.
    checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in qsa_jax.CUSTOM_CALL_TARGETS]
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        jax.export.export(top4, disabled_checks=checks)(*args)


@pytest.mark.gpu
def test_export_on_the_gpu_round_trips_with_the_custom_call_check_lifted():
    top4, args = _top4()
    checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in qsa_jax.CUSTOM_CALL_TARGETS]
    exported = jax.export.export(top4, disabled_checks=checks)(*args)
    restored = jax.export.deserialize(exported.serialize())
    assert np.array_equal(np.asarray(restored.call(*args)), np.asarray(top4(*args)))
