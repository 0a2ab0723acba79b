"""hvdtrain.torch's optimizer pieces on one process: a sparse gradient's all-gather context
passes through DenseLayout, and a resume at momentum 0 keeps no stale momentum buffer."""
import torch


def test_dense_layout_passes_a_sparse_gradients_context_through():
    # Horovod's sparse path (nn.Embedding(sparse=True)) decompresses with ctx=None; DenseLayout
    # read ctx[:2] and raised TypeError.
    import horovod.torch as hvd

    from hvdtrain.torch.optimizer import DenseLayout
    grad = torch.ones(3)
    assert DenseLayout(hvd.Compression.none).decompress(grad, None) is grad


def _trained_sgd(momentum):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    model(torch.ones(4, 2)).sum().backward()
    opt.step()
    return model, opt


def test_a_resume_at_momentum_0_drops_the_momentum_buffers():
    # 0.9 -> 0 -> 0.9: the third run must not pick up the first run's buffers again.
    from hvdtrain.torch.checkpoint import load_optimizer
    _, first = _trained_sgd(0.9)
    saved = first.state_dict()
    assert all("momentum_buffer" in s for s in saved["state"].values())
    model = torch.nn.Linear(2, 1)
    second = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    changed = load_optimizer(second, saved)
    assert changed["momentum"] == (0.9, 0.0)
    assert not any("momentum_buffer" in s for s in second.state_dict()["state"].values())


def test_dense_layouts_are_sent_as_views_of_their_own_memory():
    # #50: a channels_last gradient (and any dense permutation: channels_last_3d, a transpose)
    # goes to Horovod as a contiguous view of its memory, so the in-place all-reduce writes the
    # gradient itself; decompress gives back its shape and strides. Memory with gaps (a slice)
    # is still copied, and the result takes the gradient's layout.
    import horovod.torch as hvd
    import torch

    from hvdtrain.torch.optimizer import DenseLayout
    layout = DenseLayout(hvd.Compression.none)
    for grad in (torch.randn(8, 3, 3, 3).contiguous(memory_format=torch.channels_last),
                 torch.randn(8, 3, 1, 1).contiguous(memory_format=torch.channels_last),
                 torch.randn(2, 3, 4, 5, 6).contiguous(memory_format=torch.channels_last_3d),
                 torch.randn(5, 7).t(), torch.randn(4, 1, 3).transpose(0, 2)):
        sent, ctx = layout.compress(grad)
        assert sent.is_contiguous() and sent.data_ptr() == grad.data_ptr()
        sent.mul_(2)  # what the in-place all-reduce does to it
        back = layout.decompress(sent, ctx)
        assert back.shape == grad.shape and back.stride() == grad.stride()
        assert back.data_ptr() == grad.data_ptr()
    gapped = torch.randn(6, 8)[:, ::2]
    sent, ctx = layout.compress(gapped)
    assert sent.is_contiguous() and sent.data_ptr() != gapped.data_ptr()
    assert torch.equal(layout.decompress(sent, ctx), gapped)
    # fp16 compression: a new contiguous tensor each way, the gradient's strides at the end
    grad = torch.randn(8, 3, 3, 3).contiguous(memory_format=torch.channels_last)
    fp16 = DenseLayout(hvd.Compression.fp16)
    sent, ctx = fp16.compress(grad)
    assert sent.dtype == torch.float16 and sent.is_contiguous()
    back = fp16.decompress(sent, ctx)
    assert back.dtype == grad.dtype and back.stride() == grad.stride()
    assert torch.allclose(back, grad, atol=1e-2)


def test_one_memory_layout_is_always_sent_as_one_shape():
    # Size-1 dimensions carry any stride; the view must not depend on it, or two ranks with the
    # same memory order would send different shapes (Horovod: mismatched shapes).
    import torch

    from hvdtrain.torch.buffers import contiguous_view
    a = torch.randn(2, 3, 4, 1).contiguous(memory_format=torch.channels_last)
    b = torch.empty_strided((2, 3, 4, 1), (12, 1, 3, 99))  # the same memory order
    assert not a.is_contiguous() and not b.is_contiguous()
    assert contiguous_view(a)[0].shape == contiguous_view(b)[0].shape == (2, 4, 3, 1)
