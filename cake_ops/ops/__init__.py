"""The ``cake::`` torch.library ops (definitions, CUDA registrations, autograd) and the
user entry points built on them, one module per op family."""
