"""hvdtrain.spark's Python API on a real Spark master, in one driver process (one JVM start):

    python tests/spark/spark_api_job.py spark://127.0.0.1:PORT OUT.json

Writes what each call returned or raised to OUT.json; tests/spark/test_spark_engine.py asserts.
"""
import io
import json
import os
import sys
import time


def allreduce_job(scale=1.0):
    """Every rank: Horovod over Gloo, an all-reduce of rank + 1, a line of output."""
    import os

    import horovod.torch as hvd
    import torch
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    print(f"rank {hvd.rank()} of {hvd.size()} says hello", flush=True)
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "sum": total * scale, "pid": os.getpid(), "gloo": hvd.gloo_enabled(),
            "engine": os.environ.get("HVDTRAIN_ENGINE"), "home": os.environ.get("HOME"),
            "keras_home": os.environ.get("KERAS_HOME")}


def failing_job():
    import horovod.torch as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("boom on rank 1")
    hvd.allreduce_(__import__("torch").zeros(1))  # rank 0 waits for rank 1, which is gone
    return "unreachable"


def features(seed=0):
    """The training data of :func:`keras_job`: 64 rows of 8 features and a label of 3 classes."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return rng.standard_normal((64, 8)), rng.integers(0, 3, 64)


def keras_job(data):
    """Every rank: the Keras adapter on the backend KERAS_BACKEND names (set by run's ``env``),
    a few optimizer steps on the rows of a saved DataFrame (``data``: its ``id``, ``features``
    and ``label``); rank 0's weights and how far the other ranks' are from them, and each rank's
    shard of the DataFrame."""
    import numpy as np
    import keras

    import hvdtrain.keras as hk
    from hvdtrain.keras.collectives import allgather_object
    info = hk.init(seed=3, threads=1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model, opt = hk.distribute(model, keras.optimizers.SGD(0.05, momentum=0.9))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), jit_compile=False)
    whole = data.read()  # every row, in the saved (shuffled) order; sharded by shard_dataset
    x, y = whole["features"].astype("float32"), whole["label"]
    model.fit(hk.shard_dataset(x, y, batch_size=8, shuffle=False, info=info), epochs=2,
              steps_per_epoch=4, verbose=0)
    flat = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    every = allgather_object(flat)
    part = data.shard(info.rank, info.size)  # this rank's rows only
    want_x, want_y = features()
    ids = part["id"]
    return {"backend": keras.backend.backend(), "size": info.size,
            "steps": hk.micro_batch_count(opt),
            "spread": max(float(np.abs(w - every[0]).max()) for w in every),
            "moved": float(np.abs(flat).sum()),
            "shards": allgather_object(ids.tolist()),
            "whole_ids": whole["id"].tolist(),
            "rows_match": bool((part["features"] == want_x[ids]).all()
                               and (part["label"] == want_y[ids]).all()
                               and (x[np.argsort(whole["id"])] == want_x.astype("float32")).all()),
            "dtypes": [str(part["features"].dtype), str(part["label"].dtype)]}


def saved_dataframe(spark, folder):
    """The rows of :func:`features` as a DataFrame (8 double columns put together by Spark ML's
    VectorAssembler), saved with :func:`hvdtrain.spark.save_dataframe`; and what a string column
    raised, before anything was written."""
    from pyspark.ml.feature import VectorAssembler

    import hvdtrain.spark as hs
    x, y = features()
    names = [f"f{i}" for i in range(8)]
    df = spark.createDataFrame([(i, *map(float, x[i]), int(y[i])) for i in range(len(y))],
                               ["id", *names, "label"])
    df = VectorAssembler(inputCols=names, outputCol="features").transform(df)
    os.makedirs(f"{folder}/train")  # a folder that exists, empty (mkdtemp's)
    data = hs.save_dataframe(df, f"{folder}/train", columns=["id", "features", "label"])
    refused = timed(lambda: hs.save_dataframe(df.selectExpr("id", "string(label) AS label"),
                                              f"{folder}/refused"))
    refused["written"] = os.path.exists(f"{folder}/refused")
    twice = timed(lambda: hs.save_dataframe(df, f"{folder}/twice", columns=["id", "id"]))
    return data, {"rows": data.rows, "shapes": data.shapes, "refused": refused,
                  "twice": twice, "path": data.path}


def timed(fn):
    start = time.monotonic()
    try:
        value = fn()
        return {"value": value, "seconds": time.monotonic() - start}
    except Exception as exc:  # recorded for the test to judge
        return {"error": type(exc).__name__, "message": str(exc),
                "seconds": time.monotonic() - start}


def main(master: str, out_path: str) -> None:
    from pyspark.sql import SparkSession

    import hvdtrain.spark as hs
    from hvdtrain.spark import HorovodRunner
    spark = (SparkSession.builder.master(master).appName("hvdtrain-api-test")
             .config("spark.ui.enabled", "false").config("spark.executor.memory", "768m")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    results = {"ivy": spark.sparkContext.getConf().get("spark.jars.ivy")}
    try:
        out = io.StringIO()
        results["run"] = timed(lambda: hs.run(allreduce_job, 2, kwargs={"scale": 10.0},
                                              stdout=out))
        results["run_stdout"] = out.getvalue()
        results["return_all"] = timed(lambda: hs.run(allreduce_job, 2, spark=spark,
                                                     return_all=True))
        results["runner"] = timed(lambda: HorovodRunner(np=2).run(allreduce_job, scale=2.0))
        results["driver_local"] = timed(lambda: hs.run(allreduce_job, -2))
        data, results["saved"] = saved_dataframe(spark, os.path.dirname(out_path))
        results["keras_torch"] = timed(lambda: hs.run(keras_job, 2, args=(data,),
                                                      env={"KERAS_BACKEND": "torch"}))
        results["failing"] = timed(lambda: hs.run(failing_job, 2))
        results["too_many"] = timed(lambda: hs.run(allreduce_job, 3, start_timeout=3))
    finally:
        spark.stop()
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
