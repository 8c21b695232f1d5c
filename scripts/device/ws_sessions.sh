#!/usr/bin/env bash
# On the GPU machine (after `source scripts/device/setup.sh`): 256 closed-loop WebSocket sessions of LLM-paced text
# (Opus, `auto` buffering, 30 s) against a fresh `voxgate serve` per configuration, one after another on one machine
# and checkpoint (/tmp/ck, made if missing), so that server flags or trees are compared in one device session.
#
#   scripts/device/ws_sessions.sh "LOADS" 'NAME[@TREE]=SERVE FLAGS' ['NAME[@TREE]=SERVE FLAGS' ...]
#   scripts/device/ws_sessions.sh "listen stress" 'slots192=' 'slots256=--max-batch 256'
#
# LOADS: `listen` (each session plays its audio and waits 1-3 s for its user, as a voice chat does) and/or `stress`
# (each next context at once). TREE [this repository]: the tree the server runs from (another revision's copy).
# Every server gets `--device cuda --port 8000 --synthetic-frames-per-token 3.5 --max-sessions 600` before its own
# flags. Reports, JSON, server logs and the GPU's peak memory to $OUT.
set -uo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,12p' "$0" >&2
    exit 2
fi
loads=$1
shift
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
[ -f /tmp/ck/config.json ] || python3 -m realtime.cli make-checkpoint --size 1b7 --variant custom_voice -o /tmp/ck \
    > /dev/null || exit 1
for configuration in "$@"; do
    label=${configuration%%=*} flags=${configuration#*=}
    name=${label%%@*} tree=$REPO
    [ "$label" != "$name" ] && tree=${label#*@}
    # shellcheck disable=SC2086  # the flags are words
    (cd "$tree" && exec python3 -m realtime.cli serve --model /tmp/ck --device cuda --port 8000 \
        --synthetic-frames-per-token 3.5 --max-sessions 600 $flags) > "$OUT/server-$name.log" 2>&1 &
    server=$!
    trap 'kill -INT $server 2>/dev/null' EXIT  # a failed run must not leave a server on the port
    python3 "$HERE/wait_ready.py" http://127.0.0.1:8000 600 $server || exit 1
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu-memory-$name.txt" &
    sampler=$!
    for load in $loads; do
        listen=()
        [ "$load" = listen ] && listen=(--listen)
        timeout 120 python3 "$REPO/scripts/bench_gateway.py" --url ws://127.0.0.1:8000/v1/tts/stream --sessions 256 \
            --processes 8 --duration 30 --buffering auto "${listen[@]}" --server-pid $server \
            > "$OUT/ws-256-$load-$name.json" 2> "$OUT/ws-256-$load-$name.err"
        echo "== $name, $load ($tree $flags): $(cat "$OUT/ws-256-$load-$name.json")"
    done
    kill $sampler
    echo "== $name: GPU memory used, peak $(sort -n "$OUT/gpu-memory-$name.txt" | tail -1) MiB"
    kill -INT $server
    wait $server
done
