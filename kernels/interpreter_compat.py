"""A fix for Triton 3.9's interpreter, applied only when this process interprets.

The interpreter gives a comparison of two scalars the *operand's* element type
(say int32) while its data are booleans.  Splatting such a scalar to a block
(``mask=row_ok & (cols < n)``, or a scalar mask on a block load) then builds an
int32 array, and Triton 3.9's ``load``/``store`` reject a non-boolean mask
("mask has unsupported dtype"; 3.6 accepted it, 3.7 and 3.8 were not tried).  Compiled kernels are not
affected: the compiler types the comparison as int1.  Here a splat of boolean
data stays boolean (int1), which is what the kernel means.
"""

from __future__ import annotations

import numpy as np

from . import runtime


def _apply() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_qsa_bool_splat", False):
        return
    splat = builder.create_splat

    def create_splat(self, ret_ty, arg):
        if arg.data.dtype == np.bool_:
            value = arg.data[0] if isinstance(arg.dtype, tl.block_type) else arg.data
            return interpreter.TensorHandle(np.full(ret_ty.shape, value, dtype=np.bool_), tl.int1)
        return splat(self, ret_ty, arg)

    builder.create_splat = create_splat
    builder._qsa_bool_splat = True


if runtime.INTERPRETED:
    _apply()
