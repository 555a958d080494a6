"""The ``cake::`` torch.library ops (definitions, CUDA registrations, autograd) and the
user entry points built on them, one module per op family."""

import torch

# The CUDA kernels' Python entries, registered on the dispatcher's CUDA key directly.
# ``CustomOpDef.register_kernel`` would wrap every call in a Python check that the outputs
# alias no input and in a dynamo guard: on the H200 host (torch 2.11) about 40 us of a
# GDN training step's host time, which sets the pace at the small shapes
# (tools/gdn_host_overhead.py). The bindings allocate every output, so none can alias.
_cuda_kernels = torch.library.Library("cake", "IMPL")


def cuda_kernel(name: str):
    """Decorator: ``fn`` becomes the CUDA kernel of the op ``cake::<name>``."""

    def register(fn):
        _cuda_kernels.impl(name, fn, "CUDA")
        return fn

    return register
