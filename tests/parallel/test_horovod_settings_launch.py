"""Under a plain `horovodrun -np 2` (no tuning flags), every rank's init() chooses Horovod's runtime
settings itself before hvd.init(), a variable the user set wins, and metrics.json says which
applied and who chose them; both adapters (hvdtrain.launch.tuning.rank_settings)."""
import json

import pytest

from jobs import horovodrun, job_env

CYCLE, YIELD = "HOROVOD_CYCLE_TIME", "OMPI_MCA_mpi_yield_when_idle"


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_plain_horovodrun_gets_the_cpu_rule_and_the_users_variable_wins(tmp_path, framework):
    import subprocess
    env = job_env()
    env.pop(YIELD, None)  # a user's shell: nothing set but their own fusion threshold
    env.pop(CYCLE, None)
    env["HOROVOD_FUSION_THRESHOLD"] = str(32 * 2**20)
    proc = subprocess.run(horovodrun(2, "hvdtrain", "train", "--framework", framework, "--epochs",
                                     "1", "--no-progress", "--device", "cpu", "--output-dir",
                                     str(tmp_path)),
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    settings = json.loads((tmp_path / "metrics.json").read_text())["horovod_settings"]
    assert settings[CYCLE] == {"value": "0.1", "by": "hvdtrain",
                               "why": settings[CYCLE]["why"]}
    assert settings[YIELD]["value"] == "1" and settings[YIELD]["by"] == "hvdtrain"
    assert settings["HOROVOD_FUSION_THRESHOLD"] == {"value": str(32 * 2**20), "by": "user",
                                                    "why": "set in the environment"}
