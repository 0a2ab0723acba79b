"""A reference ring all-reduce on mpi4py (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce
algorithms for clusters of workstations"): a scatter-reduce then an all-gather around the ring,
2(N-1) steps that each send and receive one chunk of S/N bytes, so every rank sends
2(N-1)/N x S bytes in all -- the bandwidth-optimal amount, and the cost model the nccl-tests
"bus bandwidth" convention (busbw = 2(N-1)/N x S / t) is built on.
"""
from __future__ import annotations

import numpy as np


def ring_allreduce(comm, data: np.ndarray) -> np.ndarray:
    """Sum ``data`` (any shape, any numeric dtype) over all ranks of ``comm`` with a ring.

    Args:
        comm: an ``mpi4py.MPI.Comm``.
        data: this rank's array; unchanged.

    Returns:
        A new array of ``data``'s shape and dtype holding the element-wise sum over ranks.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    flat = np.ascontiguousarray(data).reshape(-1).copy()
    if size == 1:
        return flat.reshape(data.shape)
    chunks = np.array_split(np.arange(flat.size), size)
    bounds = [(int(c[0]) if len(c) else 0, int(c[-1]) + 1 if len(c) else 0) for c in chunks]
    right, left = (rank + 1) % size, (rank - 1) % size
    recv = np.empty(max(b - a for a, b in bounds), dtype=flat.dtype)
    # Scatter-reduce: after step s, rank r holds the full sum of chunk (r - s - 1) mod N + ...
    for step in range(size - 1):
        send_idx = (rank - step) % size
        recv_idx = (rank - step - 1) % size
        s0, s1 = bounds[send_idx]
        r0, r1 = bounds[recv_idx]
        comm.Sendrecv(flat[s0:s1], dest=right, recvbuf=recv[:r1 - r0], source=left)
        flat[r0:r1] += recv[:r1 - r0]
    # All-gather: pass the completed chunks around the ring.
    for step in range(size - 1):
        send_idx = (rank - step + 1) % size
        recv_idx = (rank - step) % size
        s0, s1 = bounds[send_idx]
        r0, r1 = bounds[recv_idx]
        comm.Sendrecv(flat[s0:s1], dest=right, recvbuf=recv[:r1 - r0], source=left)
        flat[r0:r1] = recv[:r1 - r0]
    return flat.reshape(data.shape)


def main(argv: list[str] | None = None) -> None:
    """Self-check under mpirun: ``mpirun -np 3 python benchmarks/ring.py [--json-out F]`` prints
    OK on rank 0 and, with ``--json-out``, writes ``{"size": N, "cases": C, "ok": true}`` there.

    Raises:
        AssertionError: the ring's result differs from ``MPI_Allreduce``'s (on the rank that saw it).
    """
    import argparse
    import json

    from mpi4py import MPI
    parser = argparse.ArgumentParser(description="ring all-reduce self-check")
    parser.add_argument("--json-out", help="rank 0 writes the result JSON here")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    cases = 0
    rng = np.random.default_rng(comm.Get_rank())
    for n in (1, 2, 7, 1000, 4099):
        for dtype in (np.float64, np.int64):
            x = (rng.standard_normal(n) * 100).astype(dtype)
            expected = np.empty_like(x)
            comm.Allreduce(x, expected, op=MPI.SUM)
            got = ring_allreduce(comm, x)
            assert got.dtype == x.dtype and got.shape == x.shape
            assert np.allclose(got, expected, rtol=1e-12, atol=1e-9), (n, dtype)
            cases += 1
    cases = comm.allreduce(cases, op=MPI.MIN)  # every rank checked every case
    if comm.Get_rank() == 0:
        print(f"OK ring_allreduce matches MPI_Allreduce on {comm.Get_size()} ranks")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"size": comm.Get_size(), "cases": cases, "ok": True}, f)


if __name__ == "__main__":
    main()
