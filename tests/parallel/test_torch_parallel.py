"""The PyTorch adapter on 2 real ranks (the session's rank pool: tests/parallel/rankpool.py) against
one process on the global batch in the same job (rank 0, rank-local), and `hvdtrain train`
under real `horovodrun -np 2` / `mpirun -np 2` launches."""
import json

import numpy as np
import pytest
import torch

from jobs import MAIN_EPOCHS, MAIN_EPOCHS_K2, Console, horovodrun, mpirun, rank_script, run
from rankpool import TIMELINE_ENV
from hvdtrain import datasets
from hvdtrain.torch.models import build_model


def equivalence(ranks, tmp_path, samples, extra=()):
    par, ref = tmp_path / "par.npz", tmp_path / "ref.npz"
    args = ["--samples", str(samples), "--batch-size", "8", "-k", "2", "--epochs", "2"]
    ranks.run(rank_script("torch_equivalence.py"), "--out", par, *args, *extra)
    ranks.run(rank_script("torch_equivalence.py"), "--reference", "--world-size", "2",
              "--out", ref, *args, ranks=[0])
    return np.load(par), np.load(ref)


@pytest.mark.parametrize("samples,steps", [(384, 24), (176, 12)],
                         ids=["full-groups", "partial-last-group"])
def test_np2_k2_equals_single_process_global_batch(ranks, tmp_path, samples, steps):
    # 176 samples: 88 per rank = 11 micro-batches of 8, so each epoch ends with a group of 1.
    par, ref = equivalence(ranks, tmp_path, samples)
    assert int(par["size"]) == 2
    assert int(par["steps"]) == int(ref["steps"]) == steps >= 10
    assert float(par["rank_spread"]) == 0.0  # ranks agree exactly
    diff = float(np.abs(par["weights"] - ref["weights"]).max())
    assert diff <= 1e-5, f"max |w_parallel - w_reference| = {diff}"


def test_naive_fixed_loss_scale_breaks_the_partial_group(ranks, tmp_path):
    # Control: scaling every micro-batch by 1/k (not by the group's size) must be caught.
    par, ref = equivalence(ranks, tmp_path, 176, extra=("--fixed-scale",))
    assert float(np.abs(par["weights"] - ref["weights"]).max()) > 1e-3


def test_broadcast_makes_params_buffers_and_optimizer_state_equal(ranks, tmp_path):
    out = tmp_path / "b.json"
    ranks.run(rank_script("torch_broadcast.py"), "--out", out)
    result = json.loads(out.read_text())
    assert result["size"] == 2
    keys = result["keys"]
    assert "model.1.running_mean" in keys and "opt.0.exp_avg_sq" in keys and "opt.0.step" in keys
    assert result["spread_before"] > 1e-3  # ranks really started apart
    assert result["spread_after"] == 0.0
    assert result["root_changed"] == 0.0  # rank 0 kept its own state, optimizer state included


def test_k4_runs_a_quarter_of_the_allreduces_of_k1(pools, tmp_path):
    out = tmp_path / "c.json"
    pools.get(TIMELINE_ENV).run(rank_script("torch_allreduce_count.py"), "--out", out)
    c = json.loads(out.read_text())
    assert c["k1"]["micro_batches"] == c["k4"]["micro_batches"] == 32
    assert c["k1"]["allreduces"] == c["k1"]["parameters"] * 32
    assert c["k4"]["allreduces"] * 4 == c["k1"]["allreduces"]
    # Horovod's own timeline saw exactly those executions.
    assert c["k1"]["timeline_allreduces"] == c["k1"]["allreduces"]
    assert c["k4"]["timeline_allreduces"] == c["k4"]["allreduces"]
    assert c["k4"]["optimizer_steps"] == 8


def check_main_job(out_dir, size=2):
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["size"] == size and metrics["framework"] == "torch"
    assert metrics["global_batch"] == (metrics["local_batch"] * size
                                      * metrics["backward_passes_per_step"])
    assert len(metrics["epochs"]) == metrics["config"]["epochs"]
    assert metrics["final_test_accuracy"] >= 0.95, metrics["epochs"][-1]
    assert all(e["samples_per_sec"] > 0 for e in metrics["epochs"])
    # The checkpoint loads safely and its model scores what the job reported.
    ckpt = torch.load(out_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == len(metrics["epochs"]) and ckpt["size"] == size
    split = datasets.load_digits()
    model = build_model()
    model.load_state_dict(ckpt["model"])
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(split.x_test)).argmax(1).numpy()
    assert float((pred == split.y_test).mean()) == pytest.approx(metrics["final_test_accuracy"])
    return metrics


def test_main_job_under_horovodrun_reaches_95_percent(tmp_path):
    proc = run(horovodrun(2, "hvdtrain", "train", "--framework", "torch", "--dataset", "digits",
                          "--epochs", MAIN_EPOCHS, "--output-dir", str(tmp_path), "--no-progress"))
    check_main_job(tmp_path)
    # Rank 0 alone logs.
    seen = Console.of(proc)
    assert f"[hvdtrain rank 0] epoch {MAIN_EPOCHS}" in seen.rank(0)
    assert "[hvdtrain rank 1]" not in seen.text


def test_main_job_under_mpirun_with_accumulation(tmp_path):
    run(mpirun(2, "hvdtrain", "train", "--framework", "torch", "--dataset", "digits",
               "--epochs", MAIN_EPOCHS_K2, "--batch-size", "8", "--backward-passes-per-step",
               "2", "--output-dir", str(tmp_path), "--no-progress"))
    m = check_main_job(tmp_path)
    assert m["global_batch"] == 32 and m["backward_passes_per_step"] == 2
    # 1437 samples -> 719 per rank -> 90 micro-batches of 8 -> 45 optimizer steps per epoch.
    assert all(e["optimizer_steps"] == 45 for e in m["epochs"])
