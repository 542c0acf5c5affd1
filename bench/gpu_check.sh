#!/usr/bin/env bash
# Prepared GPU check for a machine with one NVIDIA GPU (an H200) and NO network.
#
# What the machine needs (nothing is downloaded):
#   - this repository (any checkout; the script finds its root from its own location);
#   - a Python 3.10+ with torch built for CUDA, transformers (with Qwen2) and peft importable.
#     The project's other dependencies (pydantic, celery, redis, ...) are NOT needed: the script
#     builds a random ~100M-parameter Qwen2 model from a config (hidden 768, 12 layers, 12 heads /
#     4 KV heads, MLP 2048, vocab 32000; bf16) and loads marlaas/train/routing.py by file path.
#   - about 20 GiB of GPU memory and a few GiB of disk for nothing but the JSON output.
#
# What it measures (details in bench/gpu_check.py's docstring): decode ms/step against batch
# {1,8,64,256,1024,2048} and distinct adapters {1,8,32} (PEFT mixed-adapter batches), train-step
# time against tokens, and fused against sequential multi-adapter training steps. The measurements
# stop at a wall-clock budget (default 420 s, shared 50/20/30 by the three parts); the whole script
# is killed after BUDGET + 120 s. JSON is printed (last stdout line) and written to the path given
# as the first argument (default results/gpu_check.json).
#
# Usage:
#   bench/gpu_check.sh [OUT.json] [extra gpu_check.py args, e.g. --budget-s 300 --reps 5]
#   PYTHON=/path/to/python bench/gpu_check.sh
#   bench/gpu_check.sh results/gpu_check_cpu_smoke.json --device cpu --small   # CPU smoke test
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
OUT="results/gpu_check.json"
if [[ $# -gt 0 && "$1" != --* ]]; then
  OUT="$1"
  shift
fi
BUDGET=420
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [[ "${args[$i]}" == "--budget-s" ]]; then BUDGET="${args[$((i + 1))]}"; fi
done

# No network: never try the hub; keep tokenizers/OpenMP from oversubscribing.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

"$PYTHON" - <<'EOF'
import sys
try:
    import peft, torch, transformers  # noqa: F401
except ImportError as e:
    sys.exit(f"gpu_check: missing package: {e.name} (needs torch, transformers, peft)")
print(f"gpu_check: torch {torch.__version__}, cuda available: {torch.cuda.is_available()}", file=sys.stderr)
if torch.cuda.is_available():
    print(f"gpu_check: device {torch.cuda.get_device_name(0)}", file=sys.stderr)
EOF

mkdir -p "$(dirname "$OUT")"
exec timeout "$((${BUDGET%.*} + 120))" "$PYTHON" bench/gpu_check.py --out "$OUT" --budget-s "$BUDGET" "$@"
