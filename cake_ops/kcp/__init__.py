"""Context parallel ("KCP"): GDN and the short convolution over the ranks of a process
group, a packed global batch split by a plan (``build_context_kcp``) into per-rank
fragments. Compositions of the ``cake::`` ops and functional collectives
(``collectives``), so autograd gives the backward. docs/kcp.md has the math and the
layouts."""

from .context import GRID_ALIGN, LAYOUTS, Fragment, KcpContext, build_context_kcp, kcp_comm_bytes
from .gdn import gdn_kcp, kcp_saved_bytes, kcp_workspace_bytes
from .short_conv import short_conv_kcp

__all__ = ["GRID_ALIGN", "LAYOUTS", "Fragment", "KcpContext", "build_context_kcp", "gdn_kcp", "kcp_comm_bytes", "kcp_saved_bytes",
           "kcp_workspace_bytes", "short_conv_kcp"]
