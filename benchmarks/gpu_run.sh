#!/usr/bin/env bash
# The GPU checks and benchmarks behind the README tables, in one go:
# `benchmarks/gpu_run.sh [tests|kernels|main|quick|extra|flash|llada2|rollouts|quantized|nf4|dgemma|tp|matrix]` (llada2
# needs diffusers, quantized torchao, nf4 bitsandbytes installed; tp two GPUs; matrix reads MATRIX_FAMILIES).
# Runs from the repository root on a CUDA machine with torch, transformers, triton installed; writes logs to $OUT.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT="${OUT:-/tmp/hf_blockdiff_gpu}"
mkdir -p "$OUT"
bench() { python3 -m hf_blockdiff.cli bench --shape sdar-4b --prompt-len 256 "$@" --json | tail -1 | tee -a "$OUT/bench.jsonl"; }
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests kernels main)
for part in "${parts[@]}"; do
  case "$part" in
    tests)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
      python3 -m pytest -q -m gpu tests -rA 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    flash)  # the flash_attn backend (needs FlashAttention installed): its GPU tests and the main shapes
      python3 -m pytest -q -m gpu tests/test_gpu.py -k flash -rA 2>&1 | tee "$OUT/flash_tests.log" | tail -8
      for backend in triton flash_attn; do for b in 1 128; do
        bench --batch-size "$b" --new-tokens 256 --attention-backend "$backend" --skip-reference; done; done ;;
    kernels)
      python3 -m hf_blockdiff.cli bench --kernels 2>&1 | tee "$OUT/kernels.txt"
      python3 -m hf_blockdiff.cli bench --kernels --flex 2>&1 | tee "$OUT/kernels_flex.txt" ;;
    main)  # the targets: SDAR-4B shapes, bf16, prompt 256, 1024 new tokens, block 4, static 4 steps
      bench --batch-size 1 --new-tokens 1024
      bench --batch-size 128 --new-tokens 1024 ;;
    extra)  # batch sweep, block 32, multi-block, LLaDA-8B shapes (ours only where the reference is slow)
      for b in 8 32; do bench --batch-size "$b" --new-tokens 256; done
      bench --batch-size 32 --new-tokens 256 --block-size 32 --steps-per-block 32
      for k in 2 4; do bench --batch-size 32 --new-tokens 256 --max-active-blocks "$k" --block-add-threshold 0.5 \
        --decoded-token-threshold 0.5 --strategy entropy_threshold --threshold 1.0 --skip-reference; done
      python3 -m hf_blockdiff.cli bench --shape llada-8b --batch-size 8 --prompt-len 256 --new-tokens 128 --block-size 32 \
        --steps-per-block 32 --json | tail -1 | tee -a "$OUT/bench.jsonl" ;;
    quick)  # the main shapes without the (slow) reference loop
      bench --batch-size 1 --new-tokens 1024 --skip-reference
      bench --batch-size 128 --new-tokens 1024 --skip-reference ;;
    quantized)  # weight-only quantization (torchao int8 / fp8) against bf16, batch 1 and 32; int8 compiled too
      for q in none int8 fp8; do for b in 1 32; do
        bench --batch-size "$b" --new-tokens 256 --quantization "$q" --skip-reference; done; done
      bench --batch-size 1 --new-tokens 256 --quantization int8 --compile on --skip-reference ;;
    nf4)  # bitsandbytes 4-bit quantizes while loading: a random SDAR-4B checkpoint written first
      python3 -c "import torch; from hf_blockdiff.tools.bench import build_model
build_model('sdar-4b', None, 'cuda', torch.bfloat16).save_pretrained('/tmp/sdar-4b-random')"
      for b in 1 32; do bench --batch-size "$b" --new-tokens 256 --model /tmp/sdar-4b-random --quantization nf4 \
        --skip-reference; done ;;
    rollouts)  # RL rollouts: 64 prompts x 8 samples at T = 1, shared K/V against repeated prompts
      bench --batch-size 64 --num-return-sequences 8 --prompt-len 1024 --new-tokens 256 --temperature 1.0
      bench --batch-size 64 --num-return-sequences 8 --prompt-len 1024 --new-tokens 256 --temperature 1.0 \
        --shared-prefix 768 ;;
    llada2)  # LLaDA2.0-mini shapes (16B-A1B, random weights) against diffusers' LLaDA2Pipeline: block 32, 256 new
      for b in 1 32; do for editing in "" "--editing-threshold 0.5"; do
        # shellcheck disable=SC2086
        python3 -m hf_blockdiff.cli bench --shape llada2-mini --prompt-len 256 --new-tokens 256 --batch-size "$b" \
          $editing --json | tail -1 | tee -a "$OUT/bench.jsonl"; done; done ;;
    dgemma)  # DiffusionGemma 26B-A4B shapes (random weights) against transformers' generate: its GPU tests, all 30
      # layers at batch 1 and 16 (the batch-16 row needs an H200's memory), 4 layers at batch 1 and 16
      python3 -m pytest -q tests/kernels/test_canvas_scoring.py tests/kernels/test_moe_experts_kernel.py \
        tests/kernels/test_paged_attention.py -rA 2>&1 | tee "$OUT/dgemma_tests.log" | tail -3
      python3 -m pytest -q tests/models/test_diffusion_gemma_inputs.py tests/models/test_diffusion_gemma.py \
        tests/models/test_experts_capture.py tests/test_fused_experts.py -rA 2>&1 | tee -a "$OUT/dgemma_tests.log" | tail -3
      for args in "--batch-size 1" "--batch-size 16" "--layers 4 --batch-size 1" "--layers 4 --batch-size 16"; do
        # shellcheck disable=SC2086
        python3 -m hf_blockdiff.cli bench --shape diffusion-gemma-26b-a4b --prompt-len 1024 --new-tokens 1024 $args \
          --json | tail -1 | tee -a "$OUT/bench.jsonl"; done ;;
    tp)  # tensor parallel over two GPUs (issue 16): the distributed tests (the CPU ones on gloo, the gpu-marked ones on
      # NCCL with CUDA graphs: tokens equal to one GPU), then SDAR-8B shapes on one GPU and sharded over two, compiled
      # layers on and off
      python3 -m pytest -q tests/test_distributed.py -rA 2>&1 | tee "$OUT/tp_tests.log" | tail -5
      for b in 1 32; do
        sdar8b=(--shape sdar-8b --prompt-len 256 --new-tokens 256 --batch-size "$b" --skip-reference --json)
        python3 -m hf_blockdiff.cli bench "${sdar8b[@]}" | tail -1 | tee -a "$OUT/bench.jsonl"
        for compile in on off; do
          torchrun --nproc_per_node 2 -m hf_blockdiff.cli bench "${sdar8b[@]}" --tensor-parallel --compile "$compile" \
            | tail -1 | tee -a "$OUT/bench.jsonl"; done; done ;;
    matrix)  # every released family at its released width (random weights, layers cut to fit; tools/model_matrix.py):
      # batches 1, 8, 128 (the largest MoE: 1, 8, 16) on the fast path and eager sdpa, and fp32 fast = sdpa per family.
      # MATRIX_FAMILIES=a,b runs a group (one 10-minute window each: see the report); unset, all of them
      python3 -m hf_blockdiff.tools.model_matrix ${MATRIX_FAMILIES:+--families "$MATRIX_FAMILIES"} \
        --output "$OUT/model_matrix.jsonl" 2>>"$OUT/model_matrix.log" | tee -a "$OUT/model_matrix.md" ;;
  esac
done
