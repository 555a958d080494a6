"""Fake (meta) kernels for every ``cake::`` op, one module per op family.

They reproduce the real kernels' output shapes, dtypes and (contiguous) strides and run
the same static input checks, so torch.compile traces and errors like the eager op.
Shipped inside the package as ``cake_ops.meta``.
"""

from . import gdn, short_conv  # noqa: F401  (importing registers the fakes)
