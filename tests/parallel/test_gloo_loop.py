"""Horovod patch 13 (scripts/horovod_patches/13-gloo-loop-yields.patch) at work: under a plain
``horovodrun --gloo -np 2``, Gloo's event loop gives up its core (``sched_yield``) when a
connection it must serve is locked by Horovod's background thread, and with
``HOROVOD_GLOO_LOOP_YIELD=0`` it retries at once as upstream's does. The ranks count the
``sched_yield`` calls that return into ``gloo::transport::tcp::Pair::handleEvents`` or into the
loop that calls it, ``Loop::run`` (where the compiler made the yield a tail call), by the
addresses ``nm`` gives for them in Horovod's PyTorch library, through a preloaded counter; other
Gloo code yields too (an unbound buffer's destructor waits that way), so calls are told apart by
where they return to. Each job is its own launch: the variable is read when Horovod's library is loaded.
What the yield is worth is measured by benchmarks/gloo.py."""
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import horovodrun, job_env

# Pair::handleEvents and Loop::run (its only caller), each with its .cold part.
LOOP = ("_ZN4gloo9transport3tcp4Pair12handleEventsEi", "_ZN4gloo9transport3tcp4Loop3runEv")

# sched_yield() counted when it is called from one of the address ranges in
# HVDTRAIN_TEST_YIELD_FROM ("LIBRARY START-END START-END ...": the library's file name, hexadecimal
# offsets in it), then done; the ranks read the count through hvdtrain_test_yields().
COUNTER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
static atomic_long calls;
static char library[4096];
static unsigned long ranges[16][2];
static int nranges = -1;
static void parse(void) {
  const char* spec = getenv("HVDTRAIN_TEST_YIELD_FROM");
  nranges = 0;
  if (spec == NULL) return;
  int used = 0;
  if (sscanf(spec, "%4095s%n", library, &used) != 1) return;
  spec += used;
  while (nranges < 16 &&
         sscanf(spec, " %lx-%lx%n", &ranges[nranges][0], &ranges[nranges][1], &used) == 2) {
    nranges++;
    spec += used;
  }
}
int sched_yield(void) {
  if (nranges < 0) parse();
  void* from = __builtin_return_address(0);
  Dl_info info;
  const char* name;
  if (dladdr(from, &info) && info.dli_fname &&
      strcmp((name = strrchr(info.dli_fname, '/')) ? name + 1 : info.dli_fname, library) == 0) {
    unsigned long at = (unsigned long)((char*)from - (char*)info.dli_fbase);
    for (int i = 0; i < nranges; i++)
      if (at >= ranges[i][0] && at < ranges[i][1]) atomic_fetch_add(&calls, 1);
  }
  return (int)syscall(SYS_sched_yield);
}
long hvdtrain_test_yields(void) { return atomic_load(&calls); }
"""

# Two ranks on the machine's cores, each a compute thread and Horovod's gradients-like
# all-reduces every step: Horovod's background thread posts sends and receives on the
# connections Gloo's loop serves, so the loop finds them locked (upstream's spinning loop, on 2
# cores: about 95,000 times a second; perf probes on Pair::handleEvents, the patch's header).
JOB = """
import ctypes, json, sys
import torch
import horovod.torch as hvd
torch.set_num_threads(1)
hvd.init()
count = ctypes.CDLL(None).hvdtrain_test_yields
count.restype = ctypes.c_long
tensors = [torch.ones(n) for n in (800, 32, 18432, 64, 100000, 128, 1280, 10)]
a = torch.randn(256, 256)
before = count()
for step in range(150):
    for _ in range(10):
        a @ a
    handles = [hvd.allreduce_async_(t, name=f"g{i}") for i, t in enumerate(tensors)]
    for h in handles:
        hvd.synchronize(h)
after = count()
with open(f"{sys.argv[1]}.{hvd.rank()}", "w") as f:
    json.dump({"yields": after - before, "gloo": hvd.gloo_enabled(),
               "mpi": hvd.mpi_enabled()}, f)
"""


@pytest.fixture(scope="module")
def counter(tmp_path_factory) -> dict:
    """The counter library built, and its HVDTRAIN_TEST_YIELD_FROM for Horovod's PyTorch library:
    {"LD_PRELOAD": ..., "HVDTRAIN_TEST_YIELD_FROM": ...}."""
    cc, nm = shutil.which("cc") or shutil.which("gcc"), shutil.which("nm")
    if cc is None or nm is None:
        pytest.skip("no C compiler (cc) or nm to build the sched_yield counter")
    spec = importlib.util.find_spec("horovod")
    library = next(Path(spec.submodule_search_locations[0], "torch").glob("mpi_lib_v2*.so"))
    symbols = subprocess.run([nm, "--defined-only", "-n", str(library)], check=True,
                             capture_output=True, text=True, timeout=120).stdout.splitlines()
    starts = sorted({int(line.split()[0], 16) for line in symbols if len(line.split()) == 3})
    ranges = []
    for line in symbols:
        parts = line.split()
        if len(parts) == 3 and parts[2].removesuffix(".cold") in LOOP:
            start = int(parts[0], 16)
            ranges.append(f"{start:x}-{min(a for a in starts if a > start):x}")
    assert len(ranges) >= 2, f"{library}: not both of {LOOP} (nm: {len(symbols)} symbols)"
    where = tmp_path_factory.mktemp("yields")
    (where / "counter.c").write_text(COUNTER)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(where / "counter.so"),
                    str(where / "counter.c"), "-ldl"], check=True, capture_output=True,
                   timeout=120)
    return {"LD_PRELOAD": str(where / "counter.so"),
            "HVDTRAIN_TEST_YIELD_FROM": " ".join([library.name, *ranges])}


def _yields(tmp_path, counter: dict, loop_yield: str | None) -> list[dict]:
    """Each rank's {"yields": n, "gloo": bool, "mpi": bool} from one horovodrun --gloo job: n
    the sched_yield() calls Gloo's loop made handling events during the job's all-reduces."""
    job, out = tmp_path / "job.py", tmp_path / "out"
    job.write_text(JOB)
    env = {**job_env(), **counter}
    env.pop("HOROVOD_GLOO_LOOP_YIELD", None)
    if loop_yield is not None:
        env["HOROVOD_GLOO_LOOP_YIELD"] = loop_yield
    proc = subprocess.run(horovodrun(2, sys.executable, str(job), str(out), extra=("--gloo",)),
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert all(r["gloo"] and not r["mpi"] for r in ranks), ranks
    return ranks


def test_the_gloo_loop_yields_its_core_where_a_connection_is_locked(tmp_path, counter):
    ranks = _yields(tmp_path, counter, None)
    assert sum(r["yields"] for r in ranks) > 0, ranks


def test_the_variable_at_0_keeps_upstreams_loop(tmp_path, counter):
    ranks = _yields(tmp_path, counter, "0")
    assert [r["yields"] for r in ranks] == [0, 0], ranks
