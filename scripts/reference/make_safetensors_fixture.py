"""Writes tests/formats/data/tiny.safetensors with Python's `safetensors` (the
reference implementation) for the SDK reader test (tests/formats/safetensors_test.cpp).

Run: .deps/bench/bin/python scripts/reference/make_safetensors_fixture.py
(the venv of scripts/setup_bench_env.sh, with the safetensors version pinned in scripts/bench-requirements.txt).
The values are deterministic (arange-based), so the C++ test recomputes them.
"""
import pathlib

import torch
from safetensors.torch import save_file

out = pathlib.Path(__file__).resolve().parents[2] / "tests/formats/data/tiny.safetensors"
tensors = {
    "a.f32": torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.5,
    "b.f16": torch.arange(4, dtype=torch.float16) - 1.5,
    "c.bf16": torch.arange(3, dtype=torch.bfloat16) * 0.25,
    "d.f64": torch.tensor(3.25, dtype=torch.float64),  # 0-dim
    "e.i64": torch.arange(5, dtype=torch.int64) * -1000000007,
    "f.i32": torch.tensor([[1, -2], [3, -4]], dtype=torch.int32),
    "g.i16": torch.tensor([-300, 300], dtype=torch.int16),
    "h.i8": torch.tensor([-7, 7, 0], dtype=torch.int8),
    "i.u8": torch.tensor([0, 255, 17], dtype=torch.uint8),
    "j.bool": torch.tensor([True, False, True]),
    "k.empty": torch.zeros(0, 4, dtype=torch.float32),
}
save_file(tensors, str(out), metadata={"format": "pt", "note": "tiny \"fixture\""})
print(out, out.stat().st_size, "bytes")
