"""The PyTorch implementations of the ``cake::`` ops, one module per op family: they run
on every device wherever no CUDA kernel takes a call (``cake_ops.dispatch``)."""
