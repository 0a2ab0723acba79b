"""tests/gpu: hvdtrain on one NVIDIA GPU (np=1: NCCL refuses two ranks on one device).

Every test in this folder is marked ``gpu`` (``pytest -m gpu`` selects them, ``-m "not gpu"``
leaves them out) and is skipped, with the reason printed by ``pytest -rs`` (pytest.ini's ``-ra``
shows it too), where torch sees no CUDA device: the CPU machines and CI. So the folder never
vanishes silently; tests/unit/test_gpu_benchmark.py checks that the skip and its reason appear.
Where a GPU is visible but Horovod was built without GPU support, the tests fail and say how to
rebuild, instead of skipping: that machine is set up wrong for them.

The ``gpu`` fixture (:class:`gpujobs.SharedRuns`) starts ONE CUDA job for the whole session
(tests/gpu/rank_cases.py: every case one process can run, one after another) and the few side
jobs that need a process of their own, all at once; each test asserts on its own case's files.
"""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SKIP_PREFIX = "no CUDA device"


def no_gpu_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when torch sees a CUDA device."""
    import torch
    if torch.cuda.is_available():
        return None
    build = (f"a CUDA {torch.version.cuda} build: no GPU or driver visible"
             if torch.version.cuda else "a CPU-only build")
    return (f"{SKIP_PREFIX}: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"{build}); tests/gpu needs an NVIDIA GPU, a CUDA build of torch and Horovod built "
            "with NCCL (scripts/setup.sh with HVDTRAIN_GPU=1)")


def _mine(item) -> bool:
    return HERE == Path(str(item.path)).parent or HERE in Path(str(item.path)).parents


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if _mine(item)]
    if not mine:
        return
    reason = no_gpu_reason()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def horovod_with_gpu_support():
    """A GPU is visible (the tests were not skipped): Horovod must be able to reduce CUDA
    tensors, or every test here fails with this message rather than a cryptic one."""
    import horovod.torch as hvd
    if not hvd.cuda_built():
        pytest.fail("a CUDA GPU is visible but this Horovod was built without GPU support "
                    f"(nccl_built={hvd.nccl_built()}): rebuild it with scripts/setup.sh and "
                    "HVDTRAIN_GPU=1 (HOROVOD_GPU_OPERATIONS=NCCL), or leave these tests out "
                    "with -m 'not gpu'", pytrace=False)


@pytest.fixture(scope="session")
def gpu(tmp_path_factory, horovod_with_gpu_support):
    """The session's shared GPU job and side jobs (:class:`gpujobs.SharedRuns`), started at the
    first test that asks; whatever still runs is ended at the end of the session."""
    from gpujobs import SharedRuns
    runs = SharedRuns(tmp_path_factory.mktemp("gpu_jobs")).start()
    yield runs
    runs.close()
