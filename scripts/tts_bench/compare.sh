#!/usr/bin/env bash
# Runs tts_bench (run.sh) at one rate against a fresh `voxgate serve` per server configuration, one after another on
# the same machine, so that configurations (or revisions, through VOXGATE_ROOT) are compared in one device session.
#
#   scripts/tts_bench/compare.sh CHECKPOINT RPS DURATION 'NAME=SERVE FLAGS' ['NAME=SERVE FLAGS' ...]
#   scripts/tts_bench/compare.sh /tmp/ck 60 60s 'defaults=' 'fixed-all=--chunk-schedule fixed --admission all'
#
# Every server gets `--device cuda --port 8000 --synthetic-frames-per-token 3.5` before its own flags; its log goes to
# $OUT/server-NAME-RPS.log when OUT is set. VOXGATE_ROOT [this repository] is the tree the server runs from.
set -uo pipefail

if [ $# -lt 4 ]; then
    sed -n '2,9p' "$0" >&2
    exit 2
fi
CHECKPOINT=$1 RPS=$2 DURATION=$3
shift 3
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=${VOXGATE_ROOT:-$(cd "$HERE/../.." && pwd)}
LOGS=${OUT:-/tmp}

for configuration in "$@"; do
    name=${configuration%%=*} flags=${configuration#*=}
    echo "== $name: voxgate serve $flags, $RPS req/s for $DURATION ($(date -u +%H:%M:%S) UTC)" >&2
    # shellcheck disable=SC2086  # the flags are words
    (cd "$ROOT" && exec python3 -m realtime.cli serve --model "$CHECKPOINT" --device cuda --port 8000 \
        --synthetic-frames-per-token 3.5 $flags) > "$LOGS/server-$name-$RPS.log" 2>&1 &
    server=$!
    "$HERE/run.sh" http://127.0.0.1:8000 "$RPS" "$DURATION" || echo "== $name: tts_bench exited $?" >&2
    kill -INT "$server" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
    kill -KILL "$server" 2>/dev/null
    wait "$server" 2>/dev/null
done
