"""A kernel registered with register_kernel is one node on the tape, replayed, with outputs saved separately."""

import torch
from fused_kernel import FusedRMSNormGate, fused
from support import assert_bitwise

import tapesac_core

OP = "tapesac_test_kernels.fused_rmsnorm_gate.default"


def _block(use_kernel: bool):
    def block(x, w, g):
        h = x.sin()
        y, z = fused(h, w, g, 1e-6) if use_kernel else FusedRMSNormGate.apply(h, w, g, 1e-6)
        return (y * z).tanh()

    return block


def _grads(fn, args):
    out = fn(*args)
    loss = (out**2).sum()
    return loss.detach(), dict(zip("xwg", torch.autograd.grad(loss, args)))


def _args():
    torch.manual_seed(0)
    return (
        torch.randn(4, 8, requires_grad=True),
        torch.randn(8, requires_grad=True),
        torch.randn(4, 8, requires_grad=True),
    )


def test_registered_kernel_is_one_node_replayed_bitwise() -> None:
    args = _args()
    ref = _grads(_block(False), args)
    with tapesac_core.trace() as blocks:
        got = _grads(lambda *a: tapesac_core.checkpoint(_block(True), *a), args)
    assert_bitwise(ref, got)
    tape = blocks[0].tape
    assert [n.name for n in tape.nodes] == [
        "aten.sin.default",
        OP,
        "aten.mul.Tensor",
        "aten.tanh.default",
    ]
    (node,) = [n for n in tape.nodes if n.name == OP]
    assert len(node.outs) == 4  # y, z and the ctx-only sigmoid(g) and rstd
    assert node.index in blocks[0].replayed


def test_each_output_of_a_kernel_can_be_saved_on_its_own() -> None:
    args = _args()
    ref = _grads(_block(False), args)
    for j in range(4):
        with tapesac_core.use_plan({"default": {(OP, 0, j)}}), tapesac_core.trace() as blocks:
            got = _grads(lambda *a: tapesac_core.checkpoint(_block(True), *a), args)
        assert_bitwise(ref, got)
        tape = blocks[0].tape
        (node,) = [n for n in tape.nodes if n.name == OP]
        assert blocks[0].saved & set(node.outs) == {node.outs[j]} & tape.needed_sources(
            {node.outs[j]}
        )
