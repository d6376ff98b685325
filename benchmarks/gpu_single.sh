#!/usr/bin/env bash
# One H200: the PyTorch peer and jax3d at the same GPT shape in one call, then one pipeline stage's
# T_F / T_B / T_W. Usage: bash benchmarks/gpu_single.sh OUT_DIR [layers d heads seq batch]
set -uo pipefail
out=${1:-/tmp/jax3d-gpu}; L=${2:-24}; D=${3:-2048}; H=${4:-16}; S=${5:-2048}; B=${6:-16}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -f .peer/torch_gpt_peer.py ]; then
    python3 .peer/torch_gpt_peer.py --layers $L --d $D --heads $H --seq $S --batch $B --steps 20 \
        2>&1 | tee "$out/peer.txt" | tail -2
fi
python3 launch/train.py --num-layers $L --hidden-size $D --num-attention-heads $H --seq-length $S \
    --preset gpt-1.3b --bf16 --micro-batch-size $B --global-batch-size $B --vocab-size 50304 \
    --hidden-dropout 0 --attention-dropout 0 --train-iters 20 --log-interval 5 --eval-interval 0 \
    --lr-warmup-iters 2 --no-progress --log-dir "$out/jax3d" 2>&1 | tail -4
python3 benchmarks/stage_times.py --preset gpt-1.3b --stages 4 --micro-batch-size 4 --bf16 2>&1 | tail -1 | tee "$out/stage_times.json"
