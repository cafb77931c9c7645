#!/usr/bin/env bash
# The headline rows on a lent GPU machine, as plain benchmark.py runs (docs/speed.md, "The headline call"): SD2 base at
# 512px with the fast recipe at the planned microbatch, eager and compiled, from precomputed latents and with the
# encoders online, beside the published recipe at microbatch 4, in one call.
#
#     bash benchmarks/gpu_headline.sh [ROW ...]      # rows by name (default: every row, in the order below)
#
# Needs only the machine's python3 and, when present, the wheels of requirements-gpu-image.txt in .whl/ (installed
# into a target folder; no editable install, no make, no network). Rows run one after another, each only if its
# estimate fits the time left (HEADLINE_SECONDS, default 540); what each row measured is written as it ends, so a
# call cut short keeps the rows before. Into $OUT (default results/gpu-headline), at most 8 files:
#   env.txt       the device, driver and package versions
#   log.txt       every row's output
#   rows.jsonl    each row's results file (results.py's schema) on one line, with the row's name and command
#   summary.md    a line a row: img/s, MFU, peak memory allocated and reserved, microbatch, seconds, exit status
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-headline}
BUDGET=${HEADLINE_SECONDS:-540}
START=$SECONDS
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline

WHEELS=${HEADLINE_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        || { echo "gpu_headline: the wheels in $WHEELS/ did not install" >&2; exit 1; }
    echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS/ into /tmp/site"
    export PYTHONPATH=/tmp/site:$PWD
else
    echo "no wheels in $WHEELS/: using what $(command -v python3) has"
    export PYTHONPATH=$PWD
fi
# SD2 base at 512px and batch 256: hours on a CPU, for figures of nothing this script is for.
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo 'gpu_headline: no CUDA GPU here: these rows measure a GPU (on a CPU: make bench, or bash benchmarks/gpu_slice.sh to rehearse)' >&2
    exit 2
fi

# The machine's copy has no .git: each row's results file names the commit given in BENCHMARK_GIT_COMMIT.
[ -n "${BENCHMARK_GIT_COMMIT:-}" ] || [ -d .git ] \
    || echo 'gpu_headline: BENCHMARK_GIT_COMMIT unset and no .git here: the rows will name no commit' >&2
{
    date -u +%FT%TZ
    echo "commit ${BENCHMARK_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1 || echo 'no nvidia-smi'
    python3 - <<'PY' 2>&1
import importlib.metadata, platform, torch
names = ('torch', 'triton', 'numpy', 'mosaicml', 'mosaicml-streaming', 'diffusers', 'transformers', 'torchao')
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return 'absent'
print('python', platform.python_version(), ', '.join(f'{name} {version(name)}' for name in names))
print('cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())
PY
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# HEADLINE_MODEL replaces the model's flags (a CPU rehearsal: '--model_name tiny --use_synth_data --image_size 64').
SD2=${HEADLINE_MODEL:-'--model_name sd2-base --use_synth_data --image_size 512'}
# name | estimate in seconds (start, compile and the batches; on an H100) | flags
ROWS="
precomputed-fast|75|$SD2 --precomputed_latents --batch_size 256 --max_duration 10ba
online-fast|90|$SD2 --batch_size 256 --max_duration 10ba
precomputed-published-mb4|70|$SD2 --precomputed_latents --recipe published --device_train_microbatch_size 4 --batch_size 128 --max_duration 8ba
precomputed-fast-compiled|200|$SD2 --precomputed_latents --batch_size 256 --max_duration 12ba --compile
online-fast-compiled|240|$SD2 --batch_size 256 --max_duration 12ba --compile
online-published-mb4|80|$SD2 --recipe published --device_train_microbatch_size 4 --batch_size 128 --max_duration 8ba
"
# Rows given by name run in that order; none given, all of them.
wanted=${*:-$(echo "$ROWS" | cut -d'|' -f1 | xargs)}
[ -f "$OUT/summary.md" ] || printf '%s\n' '| row | img/s | MFU | peak GB allocated / reserved | microbatch | seconds | exit |' \
    '|---|---|---|---|---|---|---|' >"$OUT/summary.md"

for name in $wanted; do
    line=$(echo "$ROWS" | grep "^$name|") || { echo "gpu_headline: no row named $name" >&2; exit 2; }
    estimate=$(echo "$line" | cut -d'|' -f2)
    flags=$(echo "$line" | cut -d'|' -f3)
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt "$estimate" ]; then
        echo "skipped $name: estimate ${estimate} s, ${left} s left" | tee -a "$OUT/log.txt"
        continue
    fi
    echo "== $name (estimate ${estimate} s, ${left} s left): python3 benchmark.py $flags" | tee -a "$OUT/log.txt"
    began=$SECONDS
    # A compiled row logs its recompiles: one compile per frame is expected.
    logs=''
    case "$flags" in *--compile*) logs=recompiles ;; esac
    env ${logs:+TORCH_LOGS=$logs} timeout --kill-after=10 "$left" \
        python3 benchmark.py $flags --results_json "/tmp/$name.json" >>"$OUT/log.txt" 2>&1
    status=$?
    seconds=$((SECONDS - began))
    python3 - "$name" "/tmp/$name.json" "$status" "$seconds" "python3 benchmark.py $flags" "$OUT" <<'EOF'
import json, os, sys
name, path, status, seconds, command, out = sys.argv[1:]
row = json.load(open(path)) if os.path.exists(path) and status == '0' else {}
row.update(row_name=name, command=command, exit_status=int(status), seconds=int(seconds))
with open(os.path.join(out, 'rows.jsonl'), 'a') as rows:
    rows.write(json.dumps(row) + '\n')
def figure(key, scale=1.0, form='{:.2f}'):
    value = row.get(key)
    return form.format(value * scale) if isinstance(value, (int, float)) else '-'
peaks = f"{figure('peak_gpu_memory_gb', form='{:.1f}')} / {figure('peak_gpu_memory_reserved_gb', form='{:.1f}')}"
line = (f"| {name} | {figure('img_per_sec_per_device')} | {figure('mfu', 100, '{:.1f}%')} | {peaks} | "
        f"{row.get('device_train_microbatch_size', '-')} | {seconds} | {status} |")
with open(os.path.join(out, 'summary.md'), 'a') as summary:
    summary.write(line + '\n')
print(line)
EOF
    rm -f "/tmp/$name.json"
done
echo
cat "$OUT/summary.md"
