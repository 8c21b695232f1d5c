#!/usr/bin/env bash
# Runs nari-labs' tts_bench (github.com/nari-labs/benchmarks, unmodified) at one open-loop rate against a voxgate
# server, with our English prompt set, offline: the tool's source and its dependencies' wheels are carried in
# ignored folders of the repository (scripts/tts_bench/README.md says how they are made).
#
#   scripts/tts_bench/run.sh BASE_URL RPS DURATION [more tts_bench run options]
#   scripts/tts_bench/run.sh http://127.0.0.1:8000 10 60s
#
# Environment (defaults in brackets):
#   PYTHON            a Python >= 3.12 with pip [python3]
#   TTS_BENCH_SRC     the exported source tree of nari-labs/benchmarks [REPO/.tts_bench]
#   TTS_BENCH_WHEELS  the wheels of its dependencies that the GPU image lacks [REPO/.whl-bench]
#   TTS_BENCH_LIB     where they are installed, once (pip --target) [/tmp/tts_bench-lib]
#   TTS_BENCH_MODEL   the body's `model` [Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice, tts_bench's default]
#   TTS_BENCH_VOICE   the body's `voice` [Ryan, tts_bench's default]
#   TTS_BENCH_WARMUP  warm-up at the same rate before the measured window [10s, tts_bench's default]
#   TTS_BENCH_RESULTS where tts_bench writes the whole result, audio included [/tmp/tts_bench-results]
#   OUT               when set, the small files of the result go to $OUT/tts_bench-NAME.tar.gz
set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,20p' "$0" >&2
    exit 2
fi
BASE_URL=$1 RPS=$2 DURATION=$3
shift 3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
SRC=${TTS_BENCH_SRC:-$ROOT/.tts_bench}
WHEELS=${TTS_BENCH_WHEELS:-$ROOT/.whl-bench}
LIB=${TTS_BENCH_LIB:-/tmp/tts_bench-lib}
RESULTS=${TTS_BENCH_RESULTS:-/tmp/tts_bench-results}
NAME=rps-$RPS-$(date +%Y%m%d-%H%M%S)

# the wheels are what the GPU image lacks (pydantic, jiwer, whisper-normalizer and theirs): the rest (aiohttp, click,
# numpy, regex) is there already; tts_bench itself runs from its source tree, nothing to build
if [ ! -f "$LIB/.installed" ]; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$LIB" \
        "$WHEELS"/*.whl
    touch "$LIB/.installed"
fi
export PYTHONPATH="$SRC/tts_bench/src:$LIB${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import tts_bench.cli" || { echo "tts_bench cannot be imported: a dependency is missing" >&2; exit 1; }

# the server must be warm: tts_bench checks /health only, which answers before the model is loaded
"$PYTHON" "$ROOT/scripts/device/wait_ready.py" "$BASE_URL" 600 || exit 1

mkdir -p "$RESULTS"
status=0
"$PYTHON" -m tts_bench run --target nari --base-url "$BASE_URL" \
    --model "${TTS_BENCH_MODEL:-Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice}" --voice "${TTS_BENCH_VOICE:-Ryan}" \
    --language English --dataset "$ROOT/scripts/prompts/english_1k.jsonl" --rps "$RPS" \
    --warmup "${TTS_BENCH_WARMUP:-10s}" --duration "$DURATION" --arrival poisson --seed 0 \
    --output "$RESULTS/$NAME" "$@" || status=$?

# one archive per rate in $OUT (the device tool returns at most 8 files); the audio stays behind (hundreds of MB)
if [ -n "${OUT:-}" ] && [ -d "$RESULTS/$NAME" ]; then
    if [ -f "$SRC/REVISION" ]; then cp "$SRC/REVISION" "$RESULTS/$NAME/tts_bench-revision"; fi
    small=$(cd "$RESULTS/$NAME" && ls status.json run.json summary.json report.txt dataset-manifest.json \
        requests.jsonl tts_bench-revision 2>/dev/null || true)
    tar -czf "$OUT/tts_bench-$NAME.tar.gz" -C "$RESULTS/$NAME" $small
fi
echo "tts_bench result: $RESULTS/$NAME${OUT:+ (its small files: $OUT/tts_bench-$NAME.tar.gz)}" >&2
exit $status
