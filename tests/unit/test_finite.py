"""The non-finite guard's check of a gradient (hvdtrain.torch.collectives.finite, and
hvdtrain.keras.collectives.finite on both Keras backends) says what
``isfinite(x).all()`` says, for every kind of tensor a step can hold, in one read of it."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hvdtrain.torch.collectives import all_finite, finite

NAN, INF = float("nan"), float("inf")


def cases():
    """(name, tensor) pairs: finite and not, every float dtype, odd shapes and layouts."""
    out = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for bad in (None, NAN, INF, -INF):
            t = torch.randn(37, 5).to(dtype)
            if bad is not None:
                t[11, 3] = bad
            out.append((f"{dtype}-{bad}", t))
    both = torch.randn(8)
    both[1], both[2] = INF, -INF  # +inf and -inf: each an end of the range
    out += [("inf and -inf", both), ("empty", torch.empty(0, 3)), ("0-d", torch.tensor(2.0)),
            ("0-d nan", torch.tensor(NAN)), ("transposed", torch.randn(4, 6).t()),
            ("int", torch.arange(5)), ("bool", torch.ones(3, dtype=torch.bool)),
            ("huge but finite", torch.full((1000,), 3e38)),
            ("complex nan", torch.tensor([1 + 1j, complex(0, NAN)]))]
    return out


@pytest.mark.parametrize("name,tensor", cases(), ids=[n for n, _ in cases()])
def test_finite_says_what_isfinite_all_says(name, tensor):
    got = finite(tensor)
    assert got.dtype == torch.bool and got.shape == () and got.device == tensor.device
    assert bool(got) == bool(torch.isfinite(tensor).all()), name


def test_all_finite_over_a_list_skips_none():
    good, bad = torch.ones(3), torch.tensor([1.0, NAN])
    assert all_finite([good, None, good]) is True
    assert all_finite([good, None, bad]) is False
    assert all_finite([None]) is True and all_finite([]) is True


PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from keras import ops
    from hvdtrain.keras import collectives as B
    out = {}
    for name, bad in (("finite", None), ("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf)):
        x = np.random.default_rng(0).normal(size=(33, 7)).astype("float32")
        if bad is not None:
            x[5, 2] = bad
        flag = B.finite(B.native(ops.convert_to_tensor(x)))
        out[name] = bool(ops.convert_to_numpy(flag))
    json.dump(out, open(sys.argv[1], "w"))
""")


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_keras_finite_on_each_backend(tmp_path, backend):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out)], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == {"finite": True, "nan": False, "inf": False,
                                           "-inf": False}
