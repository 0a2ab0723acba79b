"""Host memory of ``hvdtrain.torch.broadcast_state`` for a large optimizer state.

Rank 0 holds Adam state for a model of ``--params`` float32 parameters (two moments: 8 bytes per
parameter); the other ranks hold none, as after rank 0 alone loaded a checkpoint. Each rank resets
its peak resident set size (``/proc/self/clear_refs``), broadcasts, and reports how far the peak
rose above the resident size before the broadcast. Rank 0 writes the JSON.

Launch::

    horovodrun -np 2 python tests/parallel/torch_state_memory.py --params 32000000 --out m.json
"""
import argparse
import json
from pathlib import Path

import torch
from torch import nn

import horovod.torch as hvd
import hvdtrain.torch as ht


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    info = ht.init(seed=0)
    torch.manual_seed(0)
    model = nn.Linear(args.params // 1000, 1000, bias=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if info.rank == 0:  # state as after many steps, made without temporaries
        (weight,) = model.parameters()
        optimizer.state[weight] = {"step": torch.tensor(7.0),
                                   "exp_avg": torch.full_like(weight, 0.25),
                                   "exp_avg_sq": torch.full_like(weight, 0.5)}
    state_bytes = 2 * 4 * model.weight.numel()
    # Peak RSS (VmHWM) back to the current RSS, then the broadcast alone moves it.
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kib("VmRSS")
    ht.broadcast_state(model, optimizer, root_rank=0)
    peak = status_kib("VmHWM")
    (weight,) = model.parameters()
    got = optimizer.state[weight]
    ok = (float(got["step"]) == 7.0 and bool((got["exp_avg"] == 0.25).all())
          and bool((got["exp_avg_sq"] == 0.5).all()) and got["exp_avg"].shape == weight.shape)
    me = {"rank": info.rank, "rise_bytes": (peak - before) * 1024, "state_ok": ok}
    everyone = hvd.allgather_object(me)
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"state_bytes": state_bytes, "ranks": everyone}, f)


if __name__ == "__main__":
    main()
