"""cake-ops: Gated DeltaNet training ops for PyTorch.

Every stage is a ``torch.library`` op in the ``cake::`` namespace with a fake kernel and
an autograd formula, so eager, ``torch.compile(fullgraph=True)``, CUDA-graph capture and
non-reentrant checkpointing all see single traceable ops: ``cake::gdn_fwd`` and
``cake::gdn_fwd_full`` (the forward, the second keeping its tapes), ``cake::gdn_bwd``,
``cake::gdn_fwd_final_state`` and ``cake::gdn_bwd_initial_state`` (the end states alone),
``cake::gdn_state_chain`` and ``cake::gdn_state_grad_chain`` (the chains on given
summaries, for KCP), ``cake::short_conv_fwd`` and ``cake::short_conv_bwd``.

Where things are: the ops and user functions in ``cake_ops.ops`` (one module per op
family), their PyTorch implementations in ``cake_ops.pytorch``, which implementation
takes a call in ``cake_ops.dispatch``, the fake kernels in ``cake_ops.meta``, the CUDA
sources in ``csrc/<family>/``; the math and the contracts in docs/.
"""

from ._meta import load_fake_kernels as _load_fake_kernels
from .dispatch import pytorch_implementation
from .fla import chunk_gated_delta_rule
from .layers import GatedDeltaNet
from .ops.gdn import gdn, gdn_diagnostics, gdn_saved_bytes, gdn_workspace_bytes
from .ops.short_conv import short_conv

_load_fake_kernels()

__all__ = ["gdn", "gdn_diagnostics", "gdn_saved_bytes", "gdn_workspace_bytes", "short_conv", "chunk_gated_delta_rule", "GatedDeltaNet",
           "pytorch_implementation"]
__version__ = "0.1.0"
