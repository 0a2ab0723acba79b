"""hvdtrain.torch under `horovodrun -np 2`: learning-rate handling (restored optimizers,
schedulers, warmup), Adasum and fp16 compression, unequal data, the state broadcast's memory, and
an exact resume inside the warmup with dropout (every rank's RNG restored), and a rank that waits
for a collective without using a core."""
import json

import numpy as np
import pytest
import torch

from jobs import horovodrun, rank_script, run, script, train_in

SIZE = 2


@pytest.fixture(scope="module")
def checks(pools, tmp_path_factory):
    out = tmp_path_factory.mktemp("checks") / "result.json"
    pools.get().run(rank_script("torch_adapter_checks.py"), "--out", out)
    return json.loads(out.read_text())


def test_ranks_saw_the_same(checks):
    assert checks["size"] == SIZE and checks["ranks_agree"] is True


def test_a_restored_optimizer_is_scaled_once(checks):
    r = checks["restored"]
    # The saved rate was mid-warmup (neither base nor scaled); distribute() uses the saved base.
    assert r["saved_lr"] not in (pytest.approx(0.01), pytest.approx(0.02))
    assert r["base_lr"] == pytest.approx(0.01)
    assert r["lr"] == pytest.approx(r["expected"]) and r["momentum_kept"] is True


def test_a_scheduler_built_before_distribute(checks):
    b = checks["before"]
    assert "build the scheduler after hvdtrain.torch.distribute()" in b["error"]
    # Without scaling it is allowed, and it drives the groups the wrapped optimizer uses.
    assert b["same_groups"] is True
    assert b["lrs"] == pytest.approx([0.005, 0.0025, 0.00125])


def test_warmup_composes_with_a_users_scheduler(checks):
    w = checks["warmup"]
    assert w["composed"] == pytest.approx(w["composed_expected"], rel=1e-9)
    assert w["composed"][0] == pytest.approx(0.01)  # starts at the single-process rate
    assert w["alone"] == pytest.approx(w["lr_at"], rel=1e-12)
    assert w["resumed_at_3"] == pytest.approx(w["lr_at"][3], rel=1e-12)


def test_adasum_trains_unscaled_and_refuses_linear(checks):
    a = checks["adasum"]
    assert a["lr"] == pytest.approx(0.01) and a["moved"] is True
    assert "use lr_scaling='none'" in a["linear_error"]


def test_a_rank_waiting_for_a_collective_sleeps(checks):
    # Horovod patch 11 (scripts/horovod_patches/11-torch-wait-blocks.patch): rank 0's thread sleeps
    # in synchronize() until rank 1 joins. Before, it polled with sched_yield() and took its share
    # of a core for the whole wait, from the ranks it waited for where they share cores.
    w, other = checks["wait"]
    # rank 0 waited through rank 1's work (it began waiting just before rank 1 started it)
    assert w["wall"] >= 0.5 * other["work"] > 0, (w, other)
    assert w["cpu"] <= 0.05 * w["wall"], (w, other)


def test_unequal_batch_counts_fail_on_every_rank(checks):
    messages = checks["unequal"]
    assert len(messages) == SIZE
    assert all(m and "different numbers of batches per epoch (between 3 and 4" in m
               for m in messages)


def test_a_loader_without_length_is_not_checked(checks):
    assert checks["iterable_micro_batches"] == 4  # 8 samples, batches of 2


def test_state_broadcast_memory_stays_near_the_state_size(tmp_path):
    # 24 M parameters: Adam's two moments are 192 MB. A whole state_dict through one pickled
    # object costs the root about twice that on top (pickle + byte tensor) and the others three
    # times; tensors broadcast in place cost the root nothing and the others the state itself.
    out = tmp_path / "memory.json"
    run(horovodrun(SIZE, *script("torch_state_memory.py"), "--params", "24000000",
                   "--out", str(out)))
    m = json.loads(out.read_text())
    state = m["state_bytes"]
    root, other = sorted(m["ranks"], key=lambda r: r["rank"])
    print(f"state {state / 2**20:.0f} MiB; peak rise: root {root['rise_bytes'] / 2**20:.0f} MiB, "
          f"rank 1 {other['rise_bytes'] / 2**20:.0f} MiB")
    assert root["state_ok"] and other["state_ok"]
    assert root["rise_bytes"] < 0.25 * state
    assert other["rise_bytes"] < 1.25 * state




def _weights(out):
    state = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    return np.concatenate([v.double().numpy().ravel() for v in state.values()])


def test_resume_inside_the_warmup_with_dropout_is_exact(pools, tmp_path):
    # Dropout draws from every rank's RNG; the warmup spans 2 of the 3 epochs and the run
    # is stopped after epoch 1, inside it.
    args = ["--dropout", "0.3", "--warmup-epochs", "2", "-k", "2", "--batch-size", "8"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    train_in(pools, whole, "--no-progress", "--epochs", "3", *args)
    train_in(pools, split, "--no-progress", "--epochs", "1", *args)
    train_in(pools, split, "--no-progress", "--epochs", "3", "--resume", *args)
    a = json.loads((whole / "metrics.json").read_text())
    b = json.loads((split / "metrics.json").read_text())
    assert b["resumed_from"]["epoch"] == 1
    assert [e["lr"] for e in b["epochs"]] == pytest.approx([e["lr"] for e in a["epochs"]],
                                                           rel=1e-12)
    assert np.abs(_weights(whole) - _weights(split)).max() <= 1e-6


@pytest.mark.parametrize("option", [["--op", "adasum", "--lr-scaling", "none"],
                                    ["--compression", "fp16"]])
def test_adasum_and_fp16_compression_train_the_main_job(pools, tmp_path, option):
    train_in(pools, tmp_path, "--no-progress", "--epochs", "8", *option)
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["ranks_agree"] is True and m["skipped_steps"] == 0
    assert m["final_test_accuracy"] >= 0.9, m["epochs"][-1]
