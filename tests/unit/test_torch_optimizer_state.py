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
