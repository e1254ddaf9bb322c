"""The runtime's low-precision linear: autocast's products, without a weight copy per
micro-batch in flight."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from hetplan.runtime.precision import linear, step_weights  # noqa: E402


def _autocast_linear(x, w, b):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.nn.functional.linear(x, w, b)


def _ours(x, w, b):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return linear(x, w, b)


@pytest.mark.parametrize("bias", [True, False])
def test_same_products_as_autocast(bias: bool) -> None:
    torch.manual_seed(0)
    w0 = torch.randn(24, 40)
    b0 = torch.randn(24) if bias else None
    x0 = torch.randn(3, 5, 40)
    outs, grads = [], []
    for fn in (_autocast_linear, _ours):
        w = w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if b0 is not None else None
        x = x0.clone().requires_grad_()
        y = fn(x, w, b)
        g = torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype)
        y.backward(g)
        outs.append(y)
        grads.append([x.grad, w.grad] + ([b.grad] if b is not None else []))
    assert outs[1].dtype == outs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for ours, ref in zip(grads[1], grads[0], strict=True):
        assert ours.dtype == ref.dtype == torch.float32  # back to each input's dtype
        # the same bf16 products of the same bf16 operands: bit for bit
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    # and against the products written out by hand in bf16
    bf = torch.bfloat16
    g = torch.linspace(-1, 1, outs[0].numel()).reshape(outs[0].shape).to(bf)
    want_w = (g.reshape(-1, 24).t().float() @ x0.to(bf).reshape(-1, 40).float()).to(bf).float()
    torch.testing.assert_close(grads[1][1], want_w, rtol=1e-2, atol=5e-2)


def _shared(x, w, b):
    with step_weights():
        return _ours(x, w, b)


def test_step_copy_gives_autocast_products() -> None:
    """Four micro-batches through one step's shared copy: the outputs and the gradients
    accumulated over them are autocast's, bit for bit."""
    torch.manual_seed(1)
    w0, b0 = torch.randn(16, 8), torch.randn(16)
    xs = [torch.randn(3, 8) for _ in range(4)]
    res = []
    for fn in (_autocast_linear, None):
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        if fn is None:
            with step_weights():
                ys = [_ours(x, w, b) for x in xs]
                sum(y.float().square().sum() for y in ys).backward()
        else:
            ys = [fn(x, w, b) for x in xs]
            sum(y.float().square().sum() for y in ys).backward()
        res.append((torch.stack(ys), w.grad, b.grad))
    for ours, ref in zip(res[1], res[0], strict=True):
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def _saved_new_bytes(fn, w: torch.Tensor, n: int, block=None) -> int:
    """Bytes of the distinct storages (W's own left out) that ``n`` forwards in flight save
    for their backwards."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() != w.data_ptr():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with block or contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs = [fn(torch.randn(2, 32, requires_grad=True), w, None) for _ in range(n)]
        sum(o.float().sum() for o in outs).backward()
    return sum(seen.values())


def test_weight_copies_per_micro_batch_in_flight() -> None:
    """Four forwards in flight (as GPipe holds them), each saving its bf16 input (2 x 32
    x 2 bytes): plain autocast also saves a bf16 copy of the 64 x 32 W per micro-batch;
    ours one copy shared by the step, or none outside a step (W itself is saved and cast
    again in the backward)."""
    w = torch.randn(64, 32, requires_grad=True)
    x_bytes, w_bytes = 2 * 32 * 2, 64 * 32 * 2
    assert _saved_new_bytes(_autocast_linear, w, 4) == 4 * (x_bytes + w_bytes)
    assert _saved_new_bytes(_ours, w, 4, step_weights()) == 4 * x_bytes + w_bytes
    assert _saved_new_bytes(_ours, w, 4) == 4 * x_bytes

    def unshared(x, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return linear(x, w, b, share=False)

    assert _saved_new_bytes(unshared, w, 4, step_weights()) == 4 * x_bytes


def test_step_copy_follows_the_weights_between_steps() -> None:
    """The copy lives for one step: after the optimizer changes W in place, the next step
    computes with the new W."""
    w = torch.ones(4, 4, requires_grad=True)
    x = torch.ones(1, 4)
    assert float(_shared(x, w, None).detach().sum()) == 16.0
    with torch.no_grad():
        w.mul_(2.0)
    assert float(_shared(x, w, None).detach().sum()) == 32.0


def test_plain_linear_outside_autocast_and_without_grad() -> None:
    w, x = torch.randn(8, 4, requires_grad=True), torch.randn(2, 4)
    assert linear(x, w).dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, w).dtype == torch.bfloat16
