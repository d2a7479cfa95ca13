"""An integer address as a typed pointer in compiled code, for kernels that read matrices by
address from a table (a batch of products in one call: `waste.kernels.qbatch`, `waste.kernels.bf16`)."""

from __future__ import annotations

from numba.core import types
from numba.extending import intrinsic


@intrinsic
def pointer(typingctx, address, like):
    """The integer `address` as a pointer to `like`'s dtype (for numba.carray)."""
    if not isinstance(address, types.Integer) or not isinstance(like, types.Array):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return types.CPointer(like.dtype)(address, like), codegen
