"""``cake_ops.gdn_saved_bytes`` against the tensors a ``gdn`` call's autograd node really
saves (collected by a saved-tensors hook during the forward), on both devices: the
light mode's inputs, and the full mode's tapes where the CUDA kernels take the call."""

import pytest
import torch

import cake_ops
from cake_ops.testing import make_gdn_inputs

from conftest import DEVICES


def _saved_bytes_of_call(inp, names, **options):
    leaves = {n: inp[n].detach().requires_grad_(True) for n in names}
    saved = []

    def pack(x):
        saved.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        cake_ops.gdn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], inp["cu_seqlens"],
                     initial_state=leaves.get("initial_state"), **options)
    return sum(saved)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("save_mode", ["light", "full"])
@pytest.mark.parametrize("initial_state, use_qk_l2norm, G, beta_dtype",
                         [(False, False, 1, torch.float32), (True, True, 3, torch.bfloat16), (True, False, 2, torch.float32)])
def test_saved_bytes_are_what_the_op_saves(device, save_mode, initial_state, use_qk_l2norm, G, beta_dtype):
    # K = V = 128 and bf16: the CUDA kernels' case on a GPU (the PyTorch path on the CPU).
    lengths, H = [300, 1, 64, 0, 130], 2
    inp = make_gdn_inputs(lengths, H, G * H, 128, 128, initial_state=initial_state, beta_dtype=beta_dtype,
                          device=device, seed=5)
    names = ("q", "k", "v", "g", "beta") + (("initial_state",) if initial_state else ())
    got = _saved_bytes_of_call(inp, names, use_qk_l2norm=use_qk_l2norm, save_mode=save_mode)
    want = cake_ops.gdn_saved_bytes(sum(lengths), len(lengths), H, G * H, 128, 128, dtype=inp["q"].dtype,
                                    beta_dtype=beta_dtype, cu_seqlens_dtype=inp["cu_seqlens"].dtype,
                                    initial_state=initial_state, use_qk_l2norm=use_qk_l2norm, save_mode=save_mode,
                                    device=device)
    assert got == want
    if save_mode == "full" and device == "cuda":  # the tapes: about 650 bytes a token and value head more
        light = cake_ops.gdn_saved_bytes(sum(lengths), len(lengths), H, G * H, dtype=inp["q"].dtype,
                                         beta_dtype=beta_dtype, initial_state=initial_state, device=device)
        assert want - light > 600 * sum(lengths) * G * H


def test_saved_bytes_refuses_a_bad_mode():
    with pytest.raises(ValueError, match="save_mode"):
        cake_ops.gdn_saved_bytes(64, 1, 1, 1, save_mode="heavy")


def test_workspace_bytes_refuses_bad_options():
    with pytest.raises(ValueError, match="direction"):
        cake_ops.gdn_workspace_bytes(64, 1, 1, 1, direction="sideways")
    with pytest.raises(ValueError, match="save_mode"):
        cake_ops.gdn_workspace_bytes(64, 1, 1, 1, save_mode="heavy")
    with pytest.raises(ValueError, match="segment_chunks must be -1"):
        cake_ops.gdn_workspace_bytes(64, 1, 1, 1, segment_chunks=-2)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs the CUDA kernels"):
            cake_ops.gdn_workspace_bytes(64, 1, 1, 1)
