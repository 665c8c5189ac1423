#!/usr/bin/env bash
# One call on a GPU machine runs every figure issue 41 asks of a GPU and keeps them under $OUT (default
# ./gpu-sweep): the device and JAX version, the device codec's and the memory knobs' tests on the GPU, the MFU
# sweep (batch, remat policy, attention, loss chunk) of llama-1b and gpt-350m with their --compile-only memory,
# the island's start-up cold and warm (the compilation cache), and the chip probes' cost
# (benchmarks/health.py --timing-only). Each step has its own timeout and its own log; a step that fails or
# times out is logged and the sweep goes on. Total: about 12 minutes on one H100.
#
#   pip install -c constraints.txt -e ".[dev]" && pip install "jax[cuda13]==$(python -c 'import jax; print(jax.__version__)')"
#   OUT=/path/to/results bash benchmarks/gpu_sweep.sh
set -u
OUT=${OUT:-gpu-sweep}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/sweep.log"; }
step() {  # step NAME SECONDS COMMAND...: runs COMMAND with a timeout, its output in $OUT/NAME.log
  local name=$1 secs=$2; shift 2
  log "$name: $*"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  log "$name: exit $? ($(tail -n 1 "$OUT/$name.log"))"
}

{ nvidia-smi; python -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__);
print(jax.devices())'; pip freeze | grep -i -E "^(jax|nvidia|flax|optax)"; } > "$OUT/env.txt" 2>&1

# the device codec's frames byte for byte the host's on the GPU (tests/conftest.py pins pytest to the CPU, so
# the check runs here), and its time against the host codec's for 184M values
step codec-gpu 150 python - <<'PY'
import time, numpy as np, jax
from dtrain import codec
from dtrain.train.device_codec import DeviceErrorFeedback
print("device", jax.devices()[0])
for n in (10_001, 184_000_000):
    for bits in (8, 4):
        rng = np.random.default_rng(bits)
        host, dev = codec.ErrorFeedback(n, bits, 1024), DeviceErrorFeedback(n, bits, 1024)
        for r in range(3):
            d = (rng.standard_normal(n) * 1e-3).astype(np.float32)
            t0 = time.perf_counter(); fh = codec.encode(host.compress(d)); th = time.perf_counter() - t0
            dd = jax.device_put(d); t0 = time.perf_counter(); fd = codec.encode(dev.compress(dd)); td = time.perf_counter() - t0
            same = fh == fd and (dev.residual_host().view(np.uint32) == host.residual.view(np.uint32)).all()
            print(f"codec-gpu: n={n} int{bits} round={r} identical={same} host-s={th:.3f} device-s={td:.3f}")
PY

mfu() {  # mfu NAME ARGS...: the memory estimate, then the timed run, of one point of the sweep
  local name=$1; shift
  step "compile-$name" 120 python benchmarks/mfu.py --compile-only "$@"
  step "mfu-$name" 150 python benchmarks/mfu.py --steps 10 --repeats 3 --json "$OUT/mfu-$name.json" "$@"
}
L1B=(--config llama-1b --set mesh.fsdp=1 --seq-len 2048)
mfu llama1b-b8-full-c512    "${L1B[@]}" --batch-size 8  --remat full  --loss-chunk 512
mfu llama1b-b16-full-c512   "${L1B[@]}" --batch-size 16 --remat full  --loss-chunk 512
mfu llama1b-b8-dots-c512    "${L1B[@]}" --batch-size 8  --remat dots  --loss-chunk 512
mfu llama1b-b16-dots-c1024  "${L1B[@]}" --batch-size 16 --remat dots  --loss-chunk 1024
mfu llama1b-b8-names-c512   "${L1B[@]}" --batch-size 8  --remat names --loss-chunk 512
mfu llama1b-b8-none-c512    "${L1B[@]}" --batch-size 8  --remat none  --loss-chunk 512
mfu llama1b-b8-full-xla     "${L1B[@]}" --batch-size 8  --remat full  --loss-chunk 512 --attention xla
G350=(--config gpt-350m --set mesh.fsdp=1 --batch-size 32 --seq-len 1024)
mfu gpt350m-none   "${G350[@]}" --remat none
mfu gpt350m-dots   "${G350[@]}" --remat dots
mfu gpt350m-none-c256 "${G350[@]}" --remat none --loss-chunk 256

# start-up: one island of llama-small, a cold then a warm compilation cache (its island_startup lines)
for start in cold warm; do
  step "startup-$start" 240 dtrain simulate --config llama-small --islands 1 --set train.steps=40 \
    --set run.out_dir="$OUT/runs-$start" --set worker.compile_cache="$OUT/compile-cache"
  grep -h "first step" "$OUT/startup-$start.log" >> "$OUT/startup.txt"
done

# the chip probes' cost on a real accelerator island
step health-timing 240 python benchmarks/health.py --timing-only --config small --repeats 5 --json "$OUT/health.json"

grep -h -E "^(mfu|mfu-compile|health):" "$OUT"/*.log > "$OUT/summary.txt"
log "done: $OUT/summary.txt"
