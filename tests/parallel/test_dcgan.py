"""The canonical DCGAN loop (pytorch/examples dcgan/main.py: D's gradients computed in G's step
and zeroed at D's next step, two backward passes in D's step, nothing frozen) through
hvdtrain.torch.distribute on 2 real ranks (the session's rank pool), against one process on the
global batch (tests/parallel/torch_dcgan.py); and the mistakes that still raise."""
import json

import pytest

from jobs import rank_script

SIZE = 2
D_PARAMS, G_PARAMS = 4, 4  # weight and bias of two layers each
STEPS = 5


@pytest.fixture(scope="module")
def dcgan(pools, tmp_path_factory):
    out = tmp_path_factory.mktemp("dcgan") / "result.json"
    pools.get().run(rank_script("torch_dcgan.py"), "--out", out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["module", "optimizer", "k2", "summed"])
def test_dcgan_trains_as_one_process_on_the_global_batch(dcgan, case):
    assert dcgan["size"] == SIZE
    r = dcgan[case]
    assert r["moved"] > 1e-2  # it trained
    assert r["G_vs_reference"] < 1e-5 and r["D_vs_reference"] < 1e-5
    assert r["rank_spread"] == 0.0


@pytest.mark.parametrize("case, per_d, per_g", [
    # DDP's count: D is all-reduced in each of its three backward passes an iteration
    # (real, fake, and G's step, whose result D's next zero_grad drops), G in its one.
    ("module", 3 * STEPS, STEPS), ("optimizer", 3 * STEPS, STEPS),
    # D's losses summed into one backward pass: one all-reduce in D's step, one in G's.
    ("summed", 2 * STEPS, STEPS),
    # k=2: D's two passes make one all-reduce; G's step counts one pass for D, which the next
    # zero_grad throws away with the count; G's one pass is all-reduced at its step().
    ("k2", STEPS, STEPS)])
def test_every_rank_starts_the_same_allreduces_and_none_is_left(dcgan, case, per_d, per_g):
    r = dcgan[case]
    assert r["allreduces_per_parameter"] == {"D": [per_d], "G": [per_g]}
    assert r["ranks_started_the_same"] is True
    assert r["in_flight_after_loop"] == D_PARAMS  # G's step left D's all-reduces in flight ...
    assert r["handles_left"] == 0  # ... and optimizerD.zero_grad() collected them


def test_zeroing_in_place_while_in_flight_still_raises(dcgan):
    # netD.zero_grad(set_to_none=False) writes into the gradients Horovod is all-reducing.
    messages = dcgan["zero_in_place"]
    assert len(messages) == SIZE
    for message in messages:
        assert message.startswith("RuntimeError: the gradient of model")
        assert "changed in place while its all-reduce was in flight" in message
        assert "set_to_none=True" in message


def test_clipping_before_synchronize_raises(dcgan):
    # Raw Horovod applies whatever the race left (clipped or not, rank by rank).
    for message in dcgan["clip_early"]:
        assert message.startswith("RuntimeError: the gradient of model")
        assert "call optimizer.synchronize() first" in message
