"""The Keras 3 adapter on 2 real ranks (the session's rank pool of each Keras backend:
tests/parallel/rankpool.py) against one process on the global batch in the same job (rank 0),
on both backends (KERAS_BACKEND=tensorflow and torch) where the test is about the adapter; and
`hvdtrain train` under real `horovodrun -np 2` / `mpirun -np 2` launches."""
import json

import numpy as np
import pytest

from hvdtrain import schedule
from jobs import (KERAS_BACKENDS, MAIN_EPOCHS, MAIN_EPOCHS_K2, horovodrun, mpirun, rank_script,
                  run, script)
from rankpool import TIMELINE_ENV

BACKENDS = pytest.mark.parametrize("backend", KERAS_BACKENDS)


@pytest.mark.parametrize("backend,k", [("tensorflow", 2), ("torch", 2), ("torch", 1)])
def test_np2_equals_single_process_global_batch(keras_ranks, tmp_path, backend, k):
    """k = 2: Keras's gradient accumulation, one all-reduce per 2 micro-batches. Torch backend,
    k = 1: the gradients' all-reduces start during backward (hvdtrain.keras.overlap), from the
    first step on. Its case runs 16 steps: the momentum-0.9 fit of random labels amplifies
    float rounding (a mean of 2 means against a mean of 16) beyond 1e-5 after about 20 steps
    on this backend, with or without the overlap (seen: 1.3e-7 at 16 steps, 0.018 at 24)."""
    par, ref = tmp_path / "par.npz", tmp_path / "ref.npz"
    samples, epochs = (384, 2) if k == 2 else (256, 1)
    args = ["--samples", str(samples), "--batch-size", "8", "-k", str(k), "--epochs", str(epochs)]
    keras_ranks.run(rank_script("keras_equivalence.py"), "--out", par, *args)
    keras_ranks.run(rank_script("keras_equivalence.py"), "--reference", "--world-size", "2",
                    "--out", ref, *args, ranks=[0])
    par, ref = np.load(par), np.load(ref)
    assert int(par["size"]) == 2
    steps = samples * epochs // 16 // k
    assert int(par["steps"]) == int(ref["steps"]) == steps
    assert int(par["overlapped_steps"]) == (steps if (backend, k) == ("torch", 1) else -1)
    assert float(par["rank_spread"]) == 0.0
    diff = float(np.abs(par["weights"] - ref["weights"]).max())
    assert diff <= 1e-5, f"max |w_parallel - w_reference| = {diff}"


@BACKENDS
def test_a_bfloat16_model_trains_like_the_reference(keras_ranks, tmp_path, backend):
    """keras.config.set_dtype_policy("bfloat16"): weights, gradients and the update in bfloat16.
    Before scripts/horovod_patches/17-*: on TensorFlow "Value for attr 'T' of bfloat16 is not
    in the list of allowed values" at the first broadcast, on torch "Tensor type
    torch.BFloat16Tensor is not supported.". 3 steps at k = 2: one bfloat16 step of a mean of
    16 against a float32 mean of two means rounded once differs by about an ulp (seen: 0.0026
    on TensorFlow, 0.0038 on torch); a wrong learning rate (1 rank's) by 0.042-0.046."""
    par, ref = tmp_path / "par.npz", tmp_path / "ref.npz"
    args = ["--samples", "96", "--batch-size", "8", "-k", "2", "--epochs", "1",
            "--dtype-policy", "bfloat16"]
    keras_ranks.run(rank_script("keras_equivalence.py"), "--out", par, *args)
    keras_ranks.run(rank_script("keras_equivalence.py"), "--reference", "--world-size", "2",
                    "--out", ref, *args, ranks=[0])
    par, ref = np.load(par), np.load(ref)
    assert list(par["dtypes"]) == ["bfloat16"]
    assert int(par["steps"]) == int(ref["steps"]) == 3
    assert float(par["rank_spread"]) == 0.0
    diff = float(np.abs(par["weights"] - ref["weights"]).max())
    assert diff <= 1e-2, f"max |w_parallel - w_reference| = {diff}"


@pytest.mark.parametrize("jit", ["true", "auto"])
def test_keras_jit_compile_default_and_true_train_like_the_reference(pools, tmp_path, jit):
    # TensorFlow backend: jit_compile=True compiles forward and backward with XLA and keeps
    # Horovod's all-reduce (no XLA kernel) outside the cluster; before, the step failed in
    # tf2xla. "auto" is Keras's default (no XLA on a CPU-only host).
    par, ref = tmp_path / "par.npz", tmp_path / "ref.npz"
    args = ["--samples", "384", "--batch-size", "8", "-k", "2", "--epochs", "2"]
    ranks = pools.keras("tensorflow")
    ranks.run(rank_script("keras_equivalence.py"), "--out", par, "--jit-compile", jit, *args)
    ranks.run(rank_script("keras_equivalence.py"), "--reference", "--world-size", "2",
              "--out", ref, *args, ranks=[0])
    par, ref = np.load(par), np.load(ref)
    # true: the split step was built; auto: Keras resolves it to no XLA on this CPU-only host.
    assert bool(par["jit_compile"]) == bool(par["xla_split"]) == (jit == "true")
    assert int(par["steps"]) == int(ref["steps"]) == 24
    assert float(par["rank_spread"]) == 0.0
    diff = float(np.abs(par["weights"] - ref["weights"]).max())
    assert diff <= 1e-5, f"max |w_parallel - w_reference| = {diff}"


@BACKENDS
def test_broadcast_before_the_first_step(keras_ranks, tmp_path, backend):
    out = tmp_path / "b.json"
    keras_ranks.run(rank_script("keras_broadcast.py"), "--out", out)
    r = json.loads(out.read_text())
    assert r["size"] == 2
    assert any("moving_mean" in k for k in r["keys"]) and any("iteration" in k for k in r["keys"])
    assert r["spread_before"] > 1e-3  # ranks really started apart
    assert r["spread_after"] == 0.0  # weights, BatchNorm statistics, Adam slots and step count
    assert r["root_changed"] == 0.0
    assert r["spread_after_first_batch"] == 0.0
    # rank_info() returns what init() set up: real seeds (distinct per rank), one host.
    assert all(i["same"] and i["seed"] >= 0 and i["hosts"] == 1 for i in r["rank_info"])
    assert len({i["seed"] for i in r["rank_info"]}) == 2


@BACKENDS
def test_warmup_lr_read_from_the_optimizer_follows_schedule(keras_ranks, tmp_path, backend):
    out = tmp_path / "lr.json"
    keras_ranks.run(rank_script("keras_warmup.py"), "--out", out)
    r = json.loads(out.read_text())
    k, size = r["k"], r["size"]
    for name in ("sgd_momentum", "adam"):
        rows, spe = r[name]["rows"], r[name]["steps_per_epoch"]
        assert len(rows) == r[name]["final_iterations"] == 3 * spe * k  # one row per micro-batch
        for iterations, lr in rows:
            expected = schedule.lr_at(iterations // k, base_lr=r["base_lr"][name], rule="linear",
                                      size=size, backward_passes_per_step=k,
                                      warmup_epochs=r["warmup_epochs"], steps_per_epoch=spe)
            assert lr == pytest.approx(expected, rel=1e-6), (name, iterations)
        lrs = [lr for _, lr in rows]
        assert lrs[0] == pytest.approx(r["base_lr"][name], rel=1e-6)
        assert lrs[-1] == pytest.approx(r["base_lr"][name] * size * k, rel=1e-6)


@BACKENDS
def test_k4_runs_a_quarter_of_the_allreduces_of_k1(pools, tmp_path, backend):
    out = tmp_path / "c.json"
    pools.keras(backend, **TIMELINE_ENV).run(rank_script("keras_allreduce_count.py"), "--out", out)
    c = json.loads(out.read_text())
    assert c["k1"]["micro_batches"] == c["k4"]["micro_batches"] == 32
    assert c["k1"]["timeline_allreduces"] == c["k1"]["parameters"] * 32
    assert c["k4"]["timeline_allreduces"] * 4 == c["k1"]["timeline_allreduces"]


def check_keras_job(out_dir, size=2, backend="tensorflow"):
    m = json.loads((out_dir / "metrics.json").read_text())
    assert m["framework"] == "keras" and m["size"] == size
    assert m["versions"]["keras"].startswith("3.") and m["versions"]["keras_backend"] == backend
    assert m["ranks_agree"] is True
    assert m["global_batch"] == m["local_batch"] * size * m["backward_passes_per_step"]
    assert len(m["epochs"]) == m["config"]["epochs"]
    assert m["final_test_accuracy"] >= 0.95, m["epochs"][-1]
    assert (out_dir / "checkpoint.weights.h5").stat().st_size > 0
    # Rebuild the model from the checkpoint and score the held-out split single-process.
    import keras

    from hvdtrain import datasets
    from hvdtrain.keras.models import build_model
    split = datasets.load_digits()
    model = build_model()
    model.load_weights(str(out_dir / "checkpoint.weights.h5"))
    logits = model(split.x_test.transpose(0, 2, 3, 1), training=False)
    acc = float((keras.ops.convert_to_numpy(logits).argmax(axis=1) == split.y_test).mean())
    assert acc == pytest.approx(m["final_test_accuracy"])
    return m


@BACKENDS
def test_keras_main_job_under_horovodrun_reaches_95_percent(tmp_path, backend):
    run(horovodrun(2, "hvdtrain", "train", "--framework", "keras", "--keras-backend", backend,
                   "--dataset", "digits", "--epochs", MAIN_EPOCHS, "--output-dir", str(tmp_path),
                   "--no-progress"))
    check_keras_job(tmp_path, backend=backend)


def test_keras_main_job_under_mpirun_with_accumulation(tmp_path):
    run(mpirun(2, "hvdtrain", "train", "--framework", "keras", "--dataset", "digits",
               "--epochs", MAIN_EPOCHS_K2, "--batch-size", "8", "-k", "2", "--lr", "0.01",
               "--output-dir", str(tmp_path), "--no-progress"))
    m = check_keras_job(tmp_path)
    # 1437 samples -> 718 per rank -> 90 batches of 8 -> 45 optimizer steps per epoch.
    assert all(e["optimizer_steps"] == 45 for e in m["epochs"])


def test_keras2_code_keeps_working_with_tf_keras_and_horovods_keras_layer(tmp_path):
    """README, "Keras 2 code": TF_USE_LEGACY_KERAS=1 + tf-keras 2.21 run a tf.keras program
    written for TF <= 2.15 with horovod.tensorflow.keras and Horovod's callbacks unchanged
    (scripts/horovod_patches/03-tf-keras2-legacy-callbacks.patch)."""
    out = tmp_path / "k2.json"
    run(horovodrun(2, *script("keras2_legacy.py"), "--out", str(out)),
        env={"TF_USE_LEGACY_KERAS": "1"})
    r = json.loads(out.read_text())
    assert r["size"] == 2 and r["keras_module"].startswith("tf_keras")
    assert r["optimizer_module"].startswith("tf_keras.")  # Keras 2's optimizer, wrapped by Horovod
    assert r["rank_spread"] == 0.0  # broadcast + all-reduced gradients kept the ranks equal
    assert r["losses"][-1] < r["losses"][0]
    # MetricAverageCallback: both ranks' histories hold the same (averaged) losses, though each
    # rank trained on data of its own.
    assert r["local_losses"][0] == r["local_losses"][1] == r["losses"]
    # Warmup to 0.01 x 2 by the end of epoch 1, then x0.5 per epoch from the third.
    assert r["lr"] == pytest.approx([0.02, 0.02, 0.01])
