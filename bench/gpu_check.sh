#!/usr/bin/env bash
# One-shot check of the engine on an NVIDIA GPU: correctness tests, then the benchmark, then a table.
#
#     bash bench/gpu_check.sh            # on a machine with CUDA and torch, transformers, safetensors, pytest
#     DEVICE=cpu bash bench/gpu_check.sh # the same flow on the CPU (to try the script itself)
#
# Installs nothing. Uses .venv/bin/python when there is one, else python3. The weights of the
# bundled model (models/smollm2-135m-instruct, 540 MB) are too large to carry to a lent device
# machine (64 MiB per call), so when model.safetensors is absent the script writes a model of the
# same architecture and shape with random weights (from the carried config.json and tokenizer
# files): correctness is checked against transformers on the same weights, and speed does not
# depend on the weights' values. Files written under $OUT (when set): gpu_check.json and the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=${OUT:-$(mktemp -d)}
MODEL=models/smollm2-135m-instruct
export PYTHONUNBUFFERED=1

if [ ! -f "$MODEL/model.safetensors" ]; then
    RANDOM_MODEL=$(mktemp -d)/smollm2-shape-random
    "$PY" - "$MODEL" "$RANDOM_MODEL" <<'EOF' || exit 1
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
source, target = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)
model.save_pretrained(target)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    if (source / name).exists():
        shutil.copy(source / name, target / name)
print(f"random-weight model of {source.name}'s shape written to {target}")
EOF
    MODEL=$RANDOM_MODEL
fi

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

echo "== correctness: tests/serving/engine/test_engine.py on $DEVICE"
INFERLINE_TEST_DEVICE=$DEVICE INFERLINE_TEST_MODEL=$MODEL "$PY" -m pytest -q -x -p no:cacheprovider \
    tests/serving/engine/test_engine.py 2>&1 | tee "$OUT/gpu_check_tests.log"
TESTS=${PIPESTATUS[0]}

echo "== benchmark: bench/engine.py --quick on $DEVICE (ours) and on the CPU (ours, float32)"
"$PY" bench/engine.py --quick --device "$DEVICE" --model "$MODEL" 2>&1 | tee "$OUT/gpu_check_bench_device.log"
"$PY" bench/engine.py --quick --only ours --model "$MODEL" 2>&1 | tee "$OUT/gpu_check_bench_cpu.log"

"$PY" - "$OUT" "$DEVICE" "$TESTS" <<'EOF'
import json, sys
out, device, tests = sys.argv[1], sys.argv[2], int(sys.argv[3])
def last_json(path):
    try:
        return json.loads(open(path).read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return {}
dev, cpu = last_json(f"{out}/gpu_check_bench_device.log"), last_json(f"{out}/gpu_check_bench_cpu.log")
rows = [("mixed workload tok/s", "mixed_ours_tok_s"), ("uniform 32 tok/s", "uniform_ours_tok_s"),
        ("batch-1 decode tok/s", "decode_ours_tok_s"), ("prefix TTFT on (s)", "prefix_ours_on_median_ttft_s")]
print(f"\n{'':24}{device:>14}{'cpu float32':>14}{'ratio':>10}")
figures = {"tests_passed": tests == 0}
for label, key in rows:
    a, b = dev.get(key), cpu.get(key)
    ratio = a / b if a and b else None
    print(f"{label:24}{a if a is not None else '-':>14}{b if b is not None else '-':>14}"
          f"{f'{ratio:.2f}' if ratio else '-':>10}")
    figures[f"{device}_{key}"], figures[f"cpu_{key}"] = a, b
figures["mixed_vs_cpu"] = dev.get("mixed_ours_tok_s") / cpu["mixed_ours_tok_s"] if dev.get("mixed_ours_tok_s") and cpu.get("mixed_ours_tok_s") else None
figures["decode_vs_cpu"] = dev.get("decode_ours_tok_s") / cpu["decode_ours_tok_s"] if dev.get("decode_ours_tok_s") and cpu.get("decode_ours_tok_s") else None
print("correctness tests:", "passed" if tests == 0 else "FAILED")
json.dump(figures, open(f"{out}/gpu_check.json", "w"))
print(json.dumps(figures))
EOF
exit "$TESTS"
