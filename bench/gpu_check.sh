#!/usr/bin/env bash
# One-shot GPU check for a session with an NVIDIA GPU (written for one H200 and ~15 minutes of
# device time): GPU and software versions, gradient fidelity at realistic sizes, GS's backward
# overhead and peak memory on ResNet-50, host reads and CUDA synchronisations per iteration (update, replay, step) on
# ResNet-18 and a Transformer encoder, full-step times of GS vs GradScaler at training batch sizes (ResNet-50
# batch 64, a BERT-base-shaped Transformer encoder batch 32, SegNet-basic, SSD512), and what an
# update iteration costs against a plain backward on the torchvision and RNN zoo (issue 19, item 5),
# and Lightning's FSDPStrategy and Fabric's "fsdp" with the FSDP plugins (they build only on CUDA).
#
#   bench/gpu_check.sh        # from the repository root, with `python` the project's env
#
# Every stage has a timeout so that one hang cannot eat the budget; the timeouts add up to
# 13.1 minutes. A failing stage does not stop the later ones: failures are listed at the end
# and make the exit status nonzero. Everything is also written to bench/gpu_check.log.
set -euo pipefail

cd "$(dirname "$0")/.."  # the repository root, wherever the script is called from
LOG=bench/gpu_check.log
export PYTHONUNBUFFERED=1  # progress reaches the log as it happens, not when a stage ends
FAILED=()

# stage NAME SECONDS COMMAND...: run COMMAND under a timeout, record a failure instead of exiting.
stage() {
    local name=$1 seconds=$2
    shift 2
    echo
    echo "=== ${name} (timeout ${seconds} s), $(date -u '+%Y-%m-%d %H:%M:%S UTC') ==="
    echo "+ $*"
    local start=${SECONDS} rc=0
    timeout --kill-after=5 "${seconds}" "$@" || rc=$?
    echo "=== ${name}: exit ${rc} after $((SECONDS - start)) s ==="
    if ((rc == 124 || rc == 137)); then
        FAILED+=("${name} (timed out after ${seconds} s)")
    elif ((rc != 0)); then
        FAILED+=("${name} (exit ${rc})")
    fi
}

versions() {
    python - <<'PY'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
PY
    python -m pip show torch | grep -E '^(Name|Version|Location):'
}
export -f versions  # timeout runs commands, not shell functions: it gets `bash -c versions`

# FSDPStrategy (FSDP1, one GPU) with FSDPGradientScalingPlugin against the same fit without FSDP, and
# Fabric(strategy="fsdp") with the Fabric plugin: both train, the weights agree, nothing is skipped.
fsdp() {
    python - <<'PY'
import contextlib
import torch, lightning as L, lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.data import DataLoader, TensorDataset
from gs_lightning import GradientScalingPlugin, fabric as gs_fabric
from gs_lightning.lightning import FSDPGradientScalingPlugin

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(640, 64, generator=g), torch.randint(0, 10, (640,), generator=g))

def mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp()
    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def fit(name, strategy, plugin):
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, plugins=[plugin], max_steps=20, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), DataLoader(data, batch_size=32))
    scaler = trainer.precision_plugin.scaler
    with FSDP.summon_full_params(trainer.model) if isinstance(trainer.model, FSDP) else contextlib.nullcontext():
        weights = [p.detach().float().cpu().clone() for p in trainer.model.parameters()]
    print(f"{name}: iterations {scaler.iteration}, skipped {scaler.skipped_steps}, update iterations {scaler.update_iterations}")
    return scaler, weights

fsdp_scaler, fsdp_weights = fit("FSDPStrategy", FSDPStrategy(), FSDPGradientScalingPlugin())
plain_scaler, plain_weights = fit("no FSDP", "auto", GradientScalingPlugin())
assert fsdp_scaler.iteration == 20 and fsdp_scaler.skipped_steps == plain_scaler.skipped_steps
worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(fsdp_weights, plain_weights, strict=True))
print(f"FSDPStrategy vs no FSDP: largest relative weight difference {worst:.2e}")
assert worst < 1e-3

plugin = gs_fabric.FSDPGradientScalingPlugin()
fabric = L.Fabric(accelerator="gpu", devices=1, strategy="fsdp", plugins=[plugin])
fabric.launch()
torch.manual_seed(0)
module = fabric.setup_module(mlp())
optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.1))
for x, y in fabric.setup_dataloaders(DataLoader(data, batch_size=32)):
    fabric.backward(nn.functional.cross_entropy(module(x), y))
    optimizer.step()
    optimizer.zero_grad()
print(f"Fabric fsdp: iterations {plugin.scaler.iteration}, skipped {plugin.scaler.skipped_steps}")
assert plugin.scaler.iteration == len(data) // 32 and all(torch.isfinite(p).all() for p in module.parameters())
PY
}
export -f fsdp

main() {
    echo "gpu_check on $(hostname), $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    stage "nvidia-smi" 15 nvidia-smi
    stage "versions" 40 bash -c versions
    stage "fidelity" 180 python bench/fidelity.py --device cuda --size realistic
    stage "overhead" 120 python bench/overhead.py --device cuda --autocast --arch resnet50 --batch-size 256 --image-size 224 --rounds 10
    stage "memory" 40 python bench/memory.py --device cuda --autocast --arch resnet50 --batch-size 64 --image-size 224
    stage "host_reads" 60 python bench/host_reads.py --device cuda --batch-size 64
    stage "step_time" 150 python bench/step_time.py --device cuda --size realistic --models resnet50 transformer segnet ssd512 --rounds 10
    stage "update_cost" 90 python bench/update_cost.py --device cuda --families torchvision rnn --image-size 224 --batch-scale 16 --rounds 3
    stage "fsdp" 90 bash -c fsdp
    echo
    echo "=== done, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), ${SECONDS} s ==="
    if ((${#FAILED[@]})); then
        printf 'FAILED: %s\n' "${FAILED[@]}"
        return 1
    fi
    echo "all stages passed"
}

main 2>&1 | tee "${LOG}"
