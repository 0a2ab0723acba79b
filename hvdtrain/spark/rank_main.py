"""The child process of one rank that runs a pickled function (``hvdtrain.spark.run``)::

    python -m hvdtrain.spark.rank_main PAYLOAD RESULT

PAYLOAD holds ``cloudpickle.dumps((fn, args, kwargs))``; the return value is written to RESULT
with cloudpickle. An exception prints its traceback and exits 1 (the driver quotes the output).
"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    import cloudpickle
    payload, result = argv
    with open(payload, "rb") as f:
        fn, args, kwargs = cloudpickle.load(f)
    value = fn(*args, **kwargs)
    with open(result + ".tmp", "wb") as f:
        cloudpickle.dump(value, f)
    import os
    os.replace(result + ".tmp", result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
