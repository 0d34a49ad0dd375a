#!/usr/bin/env bash
# Nsight Compute profiles of the hd128 forward kernels, te_jax next to cuDNN and tokamax, on the GPU machine:
#     bash benchmarks/install_peers.sh; PYTHONPATH=.:benchmarks:/tmp/site bash benchmarks/attention_hopper_ncu.sh
# Rows: ROWS="4096:0 16384:1" (seq:causal).  IMPLS="ours cudnn tokamax".  SET=full (ncu --set).
# BWD=1: profile the backward kernels (te_jax dK/dV(+dQ), cuDNN bprop, tokamax's backward) of a fwd+bwd call.
# Reports go to $WORK/ncu/<impl>_<seq>_<causal>.ncu-rep; for each, the details page and the SASS source page
# (per-instruction stall samples) are exported as text beside it, and a few headline metrics are printed.
# At the end the text exports (and ptxas/SASS dumps of the te_jax kernels) are packed into $OUT/ncu_text.tgz and
# the reports into $OUT/ncu_reps.tgz (the device tool brings back at most 8 files).
set -u
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/ncu_work}
mkdir -p "$WORK/ncu"
ROWS=${ROWS:-"4096:0 16384:1"}
IMPLS=${IMPLS:-"ours cudnn tokamax"}
SET=${SET:-full}
BWD=${BWD:-0}
if [ "$BWD" = 1 ]; then KERNELS='te_jax_attn_bwd_dkdv|bprop|batched_body'; BFLAG=--bwd; TAG=bwd_;
else KERNELS='te_jax_attn_fwd|flash_attention_sm90|sdpa|fprop|fmha'; BFLAG=; TAG=; fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU ($($NCU --version | tail -1))"
for row in $ROWS; do
  seq=${row%:*}; causal=${row#*:}
  cflag=""; [ "$causal" = 1 ] && cflag="--causal"
  for impl in $IMPLS; do
    name="${TAG}${impl}_${seq}_${causal}"
    rep="$WORK/ncu/$name"
    if [ "$impl" = ours ]; then export MOSAIC_GPU_DUMP_TO="$WORK/sass/$name" MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1;
    else unset MOSAIC_GPU_DUMP_TO MOSAIC_GPU_DUMP_SASS MOSAIC_GPU_DUMP_PTXAS; fi
    echo "=== $name"
    t0=$(date +%s)
    $NCU --clock-control none --kernel-name regex:"$KERNELS" \
      --launch-skip 1 --launch-count 1 --set "$SET" --import-source no -f -o "$rep" \
      python3 benchmarks/attention_hopper_ncu_gpu.py --impl "$impl" --seq "$seq" $cflag $BFLAG > "$rep.log" 2>&1
    echo "    rc $? in $(( $(date +%s) - t0 )) s; $(grep -E '^ran|==PROF==|Error|error' "$rep.log" | tail -3 | tr '\n' ' ')"
    [ -f "$rep.ncu-rep" ] || continue
    $NCU --import "$rep.ncu-rep" --page details --print-units base > "$rep.details.txt" 2>&1
    $NCU --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1 || true
    $NCU --import "$rep.ncu-rep" --page raw --csv > "$rep.raw.csv" 2>&1 || true
    grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Issue Slots Busy|Executed Ipc Active|Warp Cycles Per Issued|No Eligible|Achieved Occupancy|Shared Memory Configuration Size|Dynamic Shared" \
      "$rep.details.txt" | head -20 | sed 's/^/    /'
  done
done
gzip -f "$WORK"/ncu/*.log
ls -la "$WORK/ncu" | head -40
(cd "$WORK" && tar czf "$OUT/ncu_text.tgz" ncu/*.txt ncu/*.csv ncu/*.log.gz $(ls -d sass 2>/dev/null))
(cd "$WORK" && tar czf "$OUT/ncu_reps.tgz" ncu/*.ncu-rep)
ls -la "$OUT"
