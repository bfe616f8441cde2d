"""Python Modalities -> Modalities C++ checkpoint fixture for plugins/checkpointing/tests.

Trains torch.nn.LayerNorm(8) with AdamW (+ LinearLR) for 2 steps, saves it the way Modalities'
`checkpoint_saving_execution/dcp` does (torch.distributed.checkpoint of {"app": {model, flattened
optimizer, lr_scheduler}}), converts the DCP folder with scripts/convert_checkpoint.py into
tests/data/<name>/ and stores the parameters after a third step in tests/data/after_step_3.safetensors.
The C++ test restores the converted checkpoint into layer_norm/layer_norm + optimizer/adam_w, takes
the same third step and compares (tolerance 1e-6; both sides run PyTorch's AdamW arithmetic).

Run: .deps/bench/bin/python scripts/reference/make_checkpoint_fixture.py
(the venv of scripts/setup_bench_env.sh: torch 2.11.0 and safetensors as pinned in scripts/bench-requirements.txt).
"""
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

root = pathlib.Path(__file__).resolve().parents[2]
data = root / "plugins/checkpointing/tests/data"
name = "eid_pyref-seen_steps_2-seen_tokens_64-target_steps_10-target_tokens_320"

torch.manual_seed(0)
model = torch.nn.LayerNorm(8, eps=1e-5)
with torch.no_grad():
    model.weight.copy_(torch.linspace(0.5, 1.5, 8))
    model.bias.copy_(torch.linspace(-0.2, 0.2, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)
x = torch.linspace(-1.0, 1.0, 24).reshape(3, 8)


def step(k):
    opt.zero_grad()
    (model(x) * torch.arange(1.0, 9.0) * k).sum().backward()
    opt.step()
    sched.step()


step(1.0)
step(2.0)
state = {"app": {
    "model": model.state_dict(),
    "optimizer": get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)),
    "lr_scheduler": sched.state_dict(),
}}
with tempfile.TemporaryDirectory() as d:
    dcp_dir = pathlib.Path(d) / "checkpoints" / name
    dcp.save(state, checkpoint_id=str(dcp_dir))
    out = pathlib.Path(d) / "converted"
    subprocess.run([sys.executable, str(root / "scripts/convert_checkpoint.py"), "dcp-to-modalities", str(dcp_dir), str(out)],
                   check=True)
    shutil.rmtree(data / name, ignore_errors=True)
    shutil.copytree(out / name, data / name)

lr_at_checkpoint = opt.param_groups[0]["lr"]  # the rate of step 3
step(3.0)
save_file({"weight": model.weight.detach().clone(), "bias": model.bias.detach().clone(),
           "lr": torch.tensor(lr_at_checkpoint, dtype=torch.float64)},
          str(data / "after_step_3.safetensors"))
print("wrote", data / name, "and", data / "after_step_3.safetensors")
