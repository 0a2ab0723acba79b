"""`make bench`: every benchmark with its default configuration, tables written into
benchmarks/README.md, results in benchmarks/results/.

    .venv/bin/python benchmarks/run_all.py
"""
import json
import time

import accumulation
import allreduce
import common
import compare
import gloo
import scaling
import scaling_rule
import trainer
import vs_single


def main() -> None:
    start = time.perf_counter()
    m = common.machine()
    common.update_readme("machine", common.table(list(m), [list(m.values())]) +
                         "\n\nhvdtrain's launcher setting on this machine: mpi_yield_when_idle=1 "
                         "(ranks per host >= cores).")
    for name, module, extra in (("scaling", scaling, []), ("allreduce", allreduce, []),
                                ("accumulation", accumulation, []), ("compare", compare, []),
                                ("compare_keras", compare, ["--framework", "keras"]),
                                ("trainer", trainer, []), ("scaling_rule", scaling_rule, []),
                                ("vs_single", vs_single, []), ("gloo", gloo, [])):
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        module.main(["--readme", *extra])
        print(f"== {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(json.dumps({"total_seconds": round(time.perf_counter() - start)}))


if __name__ == "__main__":
    main()
