import numpy as np
import pytest

from hvdtrain.accumulation import leading_dim, micro_batches


def batches(sizes):
    return [(np.zeros((n, 3)), np.zeros(n)) for n in sizes]


def test_full_groups_scale_by_one_over_k():
    out = list(micro_batches(batches([8] * 8), 4))
    assert [m.sync for _, m in out] == [False, False, False, True] * 2
    assert all(m.loss_weight == pytest.approx(0.25) for _, m in out)
    assert [m.index for _, m in out] == [0, 1, 2, 3] * 2


def test_partial_last_group_scales_by_its_own_size():
    out = [m for _, m in micro_batches(batches([8] * 5), 2)]
    assert [m.group_size for m in out] == [2, 2, 2, 2, 1]
    assert out[-1].loss_weight == pytest.approx(1.0) and out[-1].sync
    assert sum(m.loss_weight for m in out) == pytest.approx(3.0)  # one per optimizer step


def test_short_last_batch_is_weighted_by_samples():
    out = [m for _, m in micro_batches(batches([8, 8, 8, 4]), 2)]
    assert [m.loss_weight for m in out[2:]] == pytest.approx([8 / 12, 4 / 12])
    assert out[3].group_samples == 12


def test_batches_are_passed_through_in_order():
    data = batches([1, 2, 3, 4, 5])
    got = [b for b, _ in micro_batches(data, 3)]
    assert [leading_dim(b) for b in got] == [1, 2, 3, 4, 5]


def test_works_on_a_generator_and_on_empty_input():
    assert len(list(micro_batches((b for b in batches([2] * 7)), 3))) == 7
    assert list(micro_batches([], 3)) == []


def test_bad_k_and_empty_batch():
    with pytest.raises(ValueError, match="backward_passes_per_step must be >= 1"):
        list(micro_batches(batches([8]), 0))
    with pytest.raises(ValueError, match="batch with no samples"):
        list(micro_batches(batches([8, 0]), 2))


def test_leading_dim_forms():
    assert leading_dim({"x": np.zeros((5, 2))}) == 5
    assert leading_dim([[1, 2, 3]]) == 3
    with pytest.raises(TypeError, match="samples_of"):
        leading_dim(3.0)


def test_loss_scale_is_a_deprecated_name_of_loss_weight():
    (_, micro), = list(micro_batches(batches([4]), 1))
    with pytest.warns(DeprecationWarning, match="loss_weight"):
        assert micro.loss_scale == micro.loss_weight == 1.0
