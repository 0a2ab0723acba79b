"""Each rank reports where it runs: the test host it was started on (the server address of its
ssh session, or "local"), Horovod's local_size / cross_size, and the host count of
``hvdtrain.torch.init()``. Rank 0 writes the JSON.

Launch::

    horovodrun -np 2 --hostfile hosts python tests/parallel/whereami.py --out where.json
"""
import argparse
import json
import os
import socket

import horovod.torch as hvd
import hvdtrain.torch as ht


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    info = ht.init()
    ssh = os.environ.get("SSH_CONNECTION", "").split()
    me = {"rank": hvd.rank(), "host": ssh[2] if len(ssh) == 4 else "local",
          "hostname": socket.gethostname(), "local_size": hvd.local_size(),
          "cross_size": hvd.cross_size(), "hosts": info.hosts,
          "rank_info_hosts": ht.rank_info().hosts, "pid": os.getpid()}
    everyone = hvd.allgather_object(me)
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(everyone, f)


if __name__ == "__main__":
    main()
