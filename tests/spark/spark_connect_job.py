"""hvdtrain.spark given a Spark Connect session (#48 item 3), on a real local Spark Connect server
that PySpark starts in this process (``SparkSession.builder.remote("local[1]")``):

    python tests/spark/spark_connect_job.py OUT.json

The server listens on 127.0.0.1 on a port of its own (``SPARK_TESTING``, which the test sets,
makes PySpark take an ephemeral one, as PySpark's own tests do). Writes what each call raised to
OUT.json; tests/spark/test_spark_engine.py asserts.
"""
import json
import os
import subprocess
import sys


def job():
    return "a rank ran"  # never: the session is refused before any task starts


def outcome(call):
    try:
        value = call()
    except Exception as exc:  # the point: which error, with what message
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"value": repr(value)}


def main():
    from pyspark.sql import SparkSession

    import hvdtrain.spark as hs
    session = (SparkSession.builder.remote("local[1]")
               .config("spark.connect.grpc.binding.address", "127.0.0.1")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false").getOrCreate())
    try:
        result = {
            "session_module": type(session).__module__,
            "works": session.range(3).count(),  # a real Connect session: a query runs
            "run": outcome(lambda: hs.run(job, num_proc=1, spark=session)),
            "run_command": outcome(lambda: hs.run_command(["true"], num_proc=1, spark=session)),
        }
        # The command line, told by SPARK_REMOTE to use this server (as a user's shell would):
        # its session is made by getOrCreate(), which returns a Connect session there.
        remote = f"sc://{session.client._builder.endpoint}"
        cli = subprocess.run([sys.executable, "-m", "hvdtrain.spark", "-np", "1", "--", "true"],
                             env={**os.environ, "SPARK_REMOTE": remote}, capture_output=True,
                             text=True, timeout=240)
        result["cli"] = {"remote": remote, "rc": cli.returncode, "stderr": cli.stderr[-3000:]}
    finally:
        session.stop()
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
