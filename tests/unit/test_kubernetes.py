"""`hvdtrain launch --emit mpijob|trainjob`: the manifests validate against the operators' published
CRD schemas (pinned in k8s_schemas/, README.md there), say what the plan says, and bad input is
refused with exit 2 before anything is printed. No cluster: these are offline checks."""
import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from hvdtrain.cli import main
from hvdtrain.launch import hostfile as hf
from hvdtrain.launch import kubernetes as k8s

SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas"
HOSTFILES = Path(__file__).resolve().parents[2] / "hostfiles"
TRAIN = ["hvdtrain", "train", "--framework", "torch", "--dataset", "mnist",
         "--output-dir", "/data/runs/mnist"]


def strict(schema):
    """The schema as the API server applies it with strict field validation (kubectl's default
    since 1.27): an object with listed properties takes no others, unless it says
    ``x-kubernetes-preserve-unknown-fields`` or gives ``additionalProperties``."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for key, value in node.items():
                if key == "properties":
                    for sub in value.values():
                        walk(sub)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)
    walk(schema)
    return schema


VALIDATORS = {kind: jsonschema.Draft7Validator(strict(json.loads((SCHEMAS / name).read_text())))
              for kind, name in (("MPIJob", "mpijob-v2beta1.json"),
                                 ("TrainJob", "trainjob-v1alpha1.json"))}


def errors(doc):
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in VALIDATORS[doc["kind"]].iter_errors(doc)]


def emit(capsys, *args, command=TRAIN):
    """``hvdtrain launch --emit ... -- COMMAND``: (rc, the YAML text, stderr)."""
    rc = main(["launch", *args, "--", *command])
    out, err = capsys.readouterr()
    return rc, out, err


def emitted(capsys, *args, command=TRAIN):
    rc, out, err = emit(capsys, *args, command=command)
    assert rc == 0, err
    return yaml.safe_load(out), out


CASES = {
    "cpu-pvc": ["--image", "reg.example/hvdtrain:cpu", "-np", "4", "--slots-per-worker", "2",
                "--cpus-per-worker", "8", "--memory-per-worker", "8Gi", "--pvc", "runs"],
    "gpu": ["--image", "reg.example/hvdtrain:gpu", "--gpu", "-np", "8", "--slots-per-worker",
            "4", "--cpus-per-worker", "16", "--fusion-threshold-mb", "64"],
    "hostfile": ["--image", "hvdtrain:cpu", "--hostfile", str(HOSTFILES / "two-hosts.txt")],
}


@pytest.mark.parametrize("kind", ["mpijob", "trainjob"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_emitted_manifest_validates_against_the_pinned_crd_schema(capsys, kind, case):
    doc, _ = emitted(capsys, "--emit", kind, *CASES[case])
    assert doc["kind"] == {"mpijob": "MPIJob", "trainjob": "TrainJob"}[kind]
    assert errors(doc) == []


@pytest.mark.parametrize("kind", ["mpijob", "trainjob"])
def test_the_schema_check_can_fail(capsys, kind):
    """Controls: a misspelt field and a wrong type are caught, so a pass means something."""
    doc, _ = emitted(capsys, "--emit", kind, *CASES["cpu-pvc"])
    typo = copy.deepcopy(doc)
    typo["spec"]["slotPerWorker"] = 2
    assert any("slotPerWorker" in e for e in errors(typo))
    wrong = copy.deepcopy(doc)
    if kind == "mpijob":
        wrong["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = "2"
        wrong["spec"]["mpiImplementation"] = "OpenMPI5"
    else:
        wrong["spec"]["trainer"]["numNodes"] = "2"
        del wrong["spec"]["runtimeRef"]
    assert len(errors(wrong)) == 2, errors(wrong)


def test_mpijob_says_what_the_plan_says(capsys):
    doc, text = emitted(capsys, "--emit", "mpijob", "--job-name", "mnist", *CASES["cpu-pvc"])
    spec = doc["spec"]
    assert spec["slotsPerWorker"] == 2 and spec["sshAuthMountPath"] == "/root/.ssh"
    assert spec["launcherCreationPolicy"] == "WaitForWorkersReady"
    assert spec["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 3}
    workers = spec["mpiReplicaSpecs"]["Worker"]
    assert workers["replicas"] == 2
    pod = workers["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 300
    (worker,) = pod["containers"]
    # sshd, under hvdtrain worker: a pod's SIGTERM reaches the ranks (tests/unit/test_pod_worker.py)
    assert worker["command"] == ["hvdtrain", "worker", "--", "/usr/sbin/sshd", "-De"]
    assert worker["resources"]["limits"] == {"cpu": "8", "memory": "8Gi"}
    assert worker["volumeMounts"] == [{"name": "hvdtrain-output", "mountPath": "/data/runs/mnist"}]
    assert pod["volumes"] == [{"name": "hvdtrain-output",
                               "persistentVolumeClaim": {"claimName": "runs"}}]
    (launcher,) = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    argv, env = launcher["command"], {e["name"]: e["value"] for e in launcher["env"]}
    assert argv[:8] == ["mpirun", "--allow-run-as-root", "-np", "4", "--hostfile",
                        "/etc/mpi/hostfile", "-bind-to", "none"]
    assert argv[-len(TRAIN) - 2:] == [*TRAIN, "--resume", "auto"]
    assert env["OMP_NUM_THREADS"] == "4"  # 8 cores over 2 ranks
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"  # CPU workers: hvdtrain launch's rule
    assert "HVDTRAIN_LAUNCH_ID" not in argv and "HVDTRAIN_LAUNCH_ID" not in env
    # sshd does not hand the pod's environment to the ranks: mpirun forwards each name (-x).
    forwarded = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
    assert set(env) <= forwarded and {"PATH", "LD_LIBRARY_PATH"} <= forwarded
    assert "launcher: mpirun --allow-run-as-root -np 4" in text


def test_gpu_workers_ask_for_one_gpu_per_rank_and_busy_poll(capsys):
    doc, _ = emitted(capsys, "--emit", "mpijob", *CASES["gpu"])
    worker = doc["spec"]["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2
    limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "16", "nvidia.com/gpu": "4"}
    (launcher,) = doc["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in launcher["env"]}
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "0"
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(64 * 2**20) and env["OMP_NUM_THREADS"] == "4"


def test_trainjob_carries_the_same_launch(capsys):
    doc, _ = emitted(capsys, "--emit", "trainjob", "--trainer-runtime", "hvdtrain-mpi",
                     *CASES["cpu-pvc"])
    mpi, _ = emitted(capsys, "--emit", "mpijob", *CASES["cpu-pvc"])
    trainer = doc["spec"]["trainer"]
    launcher = mpi["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert trainer["command"] == launcher["command"] and trainer["env"] == launcher["env"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 2)
    assert doc["spec"]["runtimeRef"]["name"] == "hvdtrain-mpi"
    node = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert node["terminationGracePeriodSeconds"] == 300
    assert node["volumes"][0]["persistentVolumeClaim"] == {"claimName": "runs"}


def test_the_hostfile_the_operator_mounts_is_the_one_promised(capsys):
    """The header's hostfile is the mpi-operator's format (``newConfigMap``: "%s.%s.%s.svc
    slots=%d" of worker name, job, namespace; trainer's mpi.go writes the same line), hvdtrain's
    own hostfile parser reads it as the plan's hosts, and it holds exactly -np slots."""
    _, text = emitted(capsys, "--emit", "mpijob", "--job-name", "mnist", *CASES["cpu-pvc"])
    promised = [line[4:] for line in text.splitlines() if line.startswith("#   ")]
    assert promised == ["mnist-worker-0.mnist.default.svc slots=2",
                        "mnist-worker-1.mnist.default.svc slots=2"]
    operator = "".join("%s.%s.%s.svc slots=%d\n" % (f"mnist-worker-{i}", "mnist", "default", 2)
                       for i in range(2))
    assert k8s.operator_hostfile("mnist", 2, 2) == operator == "\n".join(promised) + "\n"
    hosts = hf.parse_hostfile(operator, k8s.HOSTFILE_PATH)
    assert [(h.name, h.slots) for h in hosts] == [("mnist-worker-0.mnist.default.svc", 2),
                                                   ("mnist-worker-1.mnist.default.svc", 2)]
    assert sum(h.slots for h in hosts) == 4


def test_resume_auto_is_added_once_and_only_to_hvdtrain_train():
    assert k8s.job_command(["hvdtrain", "train"]) == ["hvdtrain", "train", "--resume", "auto"]
    assert k8s.job_command(["hvdtrain", "train", "--resume", "never"])[-1] == "never"
    assert k8s.job_command(["hvdtrain", "train", "--resume=auto"]) == ["hvdtrain", "train",
                                                                       "--resume=auto"]
    assert k8s.job_command(["python", "train.py"]) == ["python", "train.py"]


@pytest.mark.parametrize("args,message", [
    (["--emit", "mpijob", "-np", "4"], "--emit needs --image"),
    (["--emit", "helm", "--image", "x", "-np", "4"],
     "--emit 'helm' is not known; write --emit mpijob"),
    (["--emit", "mpijob", "--image", "x", "-np", "3", "--slots-per-worker", "2"],
     "-np 3 is not a multiple of 2 slots per worker"),
    (["--emit", "mpijob", "--image", "x"], "--emit needs -np N"),
    (["--emit", "mpijob", "--image", "x", "-np", "2", "--job-name", "My_Job"],
     "--job-name 'My_Job' is not a DNS label"),
    (["--emit", "mpijob", "--image", "x", "-np", "2", "--slots-per-worker", "2",
      "--cpus-per-worker", "1"], "--cpus-per-worker 1 is fewer than the 2 ranks per worker"),
    (["--emit", "trainjob", "--image", "x", "-np", "2", "--elastic"],
     "--emit writes an mpirun launch"),
    (["--emit", "mpijob", "--image", "x", "-H", "a:2,b:1"], "every worker pod has the same slots"),
    (["--emit", "mpijob", "--image", "x", "-H", "a:2,b:2", "--slots-per-worker", "0", "-np", "4"],
     "--slots-per-worker must be at least 1, got 0"),
])
def test_bad_input_exits_2_before_anything_is_printed(capsys, args, message):
    rc, out, err = emit(capsys, *args)
    assert (rc, out) == (2, "")
    assert err.startswith("hvdtrain: error: ") and message in err


def test_hosts_with_different_slots_take_the_slots_per_worker_the_refusal_asks_for(capsys):
    manifest, _ = emitted(capsys, "--emit", "mpijob", "--image", "x", "-H", "a:2,b:1",
                          "--slots-per-worker", "2", "-np", "4")
    assert manifest["spec"]["slotsPerWorker"] == 2
    assert manifest["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 2


def test_a_pvc_needs_an_absolute_output_dir(capsys):
    rc, out, err = emit(capsys, "--emit", "mpijob", "--image", "x", "-np", "2", "--pvc", "runs",
                        command=["hvdtrain", "train"])
    assert (rc, out) == (2, "")
    assert "--output-dir, which is relative ('runs/latest')" in err


def test_without_a_pvc_the_user_is_told_resume_starts_over(capsys):
    rc, out, err = emit(capsys, "--emit", "mpijob", "--image", "x", "-np", "2")
    assert rc == 0 and "no --pvc" in err and "--resume auto starts over" in err


def test_the_pinned_schemas_name_their_source():
    readme = (SCHEMAS / "README.md").read_text()
    for text in ("kubeflow/mpi-operator", "deploy/v2beta1/mpi-operator.yaml",
                 "caa3c47fc42eb762635f78045ec0fcd1a89eb038", "kubeflow/trainer",
                 "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml",
                 "8c0f5059bd51ec3ba6d6a6a7b2e1471de7bc13b3"):
        assert text in readme
    for name in ("mpijob-v2beta1.json", "trainjob-v1alpha1.json"):
        schema = json.loads((SCHEMAS / name).read_text())
        assert "spec" in schema["properties"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_mpijob_pod_templates_validate_against_kubernetes_own_schema(capsys, case):
    """The launcher's and the workers' pod templates as core/v1 PodTemplates, against the
    Kubernetes API schema that kubernetes-validate bundles (strict: no unknown fields), with a
    control that fails."""
    kv = pytest.importorskip("kubernetes_validate")
    doc, _ = emitted(capsys, "--emit", "mpijob", *CASES[case])
    for role, replica in doc["spec"]["mpiReplicaSpecs"].items():
        template = {"apiVersion": "v1", "kind": "PodTemplate",
                    "metadata": {"name": role.lower()}, "template": replica["template"]}
        kv.validate(template, kv.latest_version(), strict=True)  # raises on an error
    template["template"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(kv.ValidationError, match="resourcez"):
        kv.validate(template, kv.latest_version(), strict=True)
