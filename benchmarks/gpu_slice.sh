#!/usr/bin/env bash
# The one command a lent GPU machine runs (docs/speed.md, "A lent GPU machine"): the next call of a loan of the GPU
# campaign (benchmarks/gpu_campaign.py), from the repo root, with nothing but the machine's python3 and, when
# present, the wheels of requirements-gpu-image.txt in .whl/ (make gpu-wheels): no editable install, no make, no
# network. `make gpu-loan LOAN=kernels` prints the command with this checkout's commit in it:
#
#     BENCHMARK_GIT_COMMIT=<commit> GPU_LOAN=kernels bash benchmarks/gpu_slice.sh
#
# It installs .whl/*.whl into a target folder when there are any (and says so, or that it uses what python3 has),
# puts the repo on the path itself, and runs the loan's next call (GPU_LOAN, one of campaign_rows.LOANS: its rows
# within 13 minutes a loan, 9 a call; without one, every step for GPU_SLICE_MINUTES, default 9 on a GPU, 3.5 on a
# CPU) into $OUT/gpu-campaign (OUT defaults to results/gpu-slice): at most 8 files, one folder down, also when a
# row fails or the call ends early. The rows landed in benchmarks/measured/ count as measured; the loan's second
# call, started at once, carries the first's folder back as results/gpu-campaign (its compile cache and its
# minutes spent). The machine's copy has no .git: BENCHMARK_GIT_COMMIT names the commit in every row.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-slice}
WHEELS=${GPU_SLICE_WHEELS:-.whl}
SITE=${GPU_SLICE_SITE:-/tmp/gpu-slice-site}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
        || { echo "gpu_slice: the wheels in $WHEELS/ did not install (pip's message above)" >&2; exit 1; }
    echo "gpu_slice: installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS/ into $SITE"
    export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    echo "gpu_slice: no wheels in $WHEELS/: using the packages $(command -v python3) has"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline

if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_slice: $(python3 -c 'import torch; print(torch.cuda.get_device_name())')"
else
    echo 'gpu_slice: no GPU here: the campaign runs its tiny CPU rows, which check the campaign, not the hardware'
fi

mkdir -p "$OUT/gpu-campaign"
RESUME=${GPU_SLICE_RESUME:-results/gpu-campaign}  # the folder a call carries back
if [ -f "$RESUME/campaign.json" ] && [ ! -f "$OUT/gpu-campaign/campaign.json" ]; then
    cp "$RESUME"/* "$OUT/gpu-campaign/"
    echo "gpu_slice: resuming from $RESUME"
fi
work=$(mktemp -d)
[ -n "${BENCHMARK_GIT_COMMIT:-}" ] || [ -d .git ] \
    || echo 'gpu_slice: BENCHMARK_GIT_COMMIT unset and no .git here: the rows will name no commit' >&2
# shellcheck disable=SC2086  # the steps are words
python3 benchmarks/gpu_campaign.py --resume --out "$OUT/gpu-campaign" --work "$work" ${GPU_LOAN:+--loan "$GPU_LOAN"} \
    ${GPU_SLICE_MINUTES:+--time_limit "$GPU_SLICE_MINUTES"} ${GPU_SLICE_STEPS:+--steps $GPU_SLICE_STEPS}
status=$?
rm -rf "$work"
exit $status
