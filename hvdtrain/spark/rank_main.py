"""The child process of one rank that runs a pickled function (``hvdtrain.spark.run``)::

    python -m hvdtrain.spark.rank_main PAYLOAD RESULT

PAYLOAD holds ``cloudpickle.dumps((fn, args, kwargs))``; the return value is written to RESULT
with cloudpickle. An exception prints its traceback and exits 1 (the driver quotes the output);
the wall-clock time it was raised goes to ``RESULT.raised`` first, before Horovod's shutdown
ends the other ranks, so the driver can name the rank that failed first
(:func:`hvdtrain.launch.ranks.cause_first`).
"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    import cloudpickle
    payload, result = argv
    with open(payload, "rb") as f:
        fn, args, kwargs = cloudpickle.load(f)
    try:
        value = fn(*args, **kwargs)
    except BaseException:
        import time
        with open(result + ".raised", "w") as f:
            f.write(repr(time.time()))
        raise
    with open(result + ".tmp", "wb") as f:
        cloudpickle.dump(value, f)
    import os
    os.replace(result + ".tmp", result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
