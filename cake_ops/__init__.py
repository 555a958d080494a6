"""cake-ops: Gated DeltaNet training ops for PyTorch.

Every stage is a ``torch.library`` op in the ``cake::`` namespace (``cake::gdn_fwd``,
``cake::gdn_bwd``, ``cake::short_conv_fwd``, ``cake::short_conv_bwd``) with a fake kernel
and an autograd formula, so eager, ``torch.compile(fullgraph=True)``, CUDA-graph capture
and non-reentrant checkpointing all see single traceable ops.
"""

from . import gdn as _gdn_ops  # noqa: F401  (defines cake::gdn_*)
from . import short_conv as _short_conv_ops  # noqa: F401  (defines cake::short_conv_*)
from ._meta import load_fake_kernels as _load_fake_kernels
from .fla import chunk_gated_delta_rule
from .gdn import gdn
from .layers import GatedDeltaNet
from .short_conv import short_conv

_load_fake_kernels()

__all__ = ["gdn", "short_conv", "chunk_gated_delta_rule", "GatedDeltaNet"]
__version__ = "0.1.0"
