#!/usr/bin/env bash
# On the GPU machine (after `source scripts/device/setup.sh`): loads against a fresh `voxgate serve` per
# configuration, one after another on one machine and checkpoint (/tmp/ck, made if missing), so that server flags or
# trees are compared in one device session.
#
#   scripts/device/ws_sessions.sh "LOADS" 'NAME[@TREE]=SERVE FLAGS' ['NAME[@TREE]=SERVE FLAGS' ...]
#   scripts/device/ws_sessions.sh "listen stress" 'slots192=' 'slots256=--max-batch 256'
#   scripts/device/ws_sessions.sh "listen listen512 tts60" 'defaults=' 'all=--admission all'
#
# LOADS, each in turn against the same server: `listen[N]` (N closed-loop WebSocket sessions [256] of LLM-paced text,
# Opus, `auto` buffering, 30 s, each playing its audio and waiting 1-3 s for its user, as a voice chat does),
# `stress[N]` (the same, each next context at once), `ttsR` (tts_bench at R req/s for $TTS_DURATION [40s] after its
# 10 s warm-up). TREE [this repository]: the tree the server runs from (another revision's copy).
# Every server gets `--device cuda --port 8000 --synthetic-frames-per-token 3.5 --max-sessions 600` before its own
# flags. Reports, JSON, server logs, the GPU's peak memory, the engine's time series (`metrics_trace.py`, 0.25 s), CPU
# by process kind (`cpu_trace.py`, 0.25 s) and the server's /metrics at the end to $OUT; with TTS_ARCHIVES=1,
# tts_bench's per-request records too (`run.sh`'s archive).
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
    python3 "$HERE/metrics_trace.py" http://127.0.0.1:8000 0.25 > "$OUT/trace-$name.jsonl" 2>&1 &
    tracer=$!
    python3 "$HERE/cpu_trace.py" 0.25 > "$OUT/cpu-$name.jsonl" 2>&1 &
    cpu=$!
    for load in $loads; do
        kind=${load%%[0-9]*} count=${load#"${load%%[0-9]*}"}
        if [ "$kind" = tts ]; then
            archive=
            [ "${TTS_ARCHIVES:-}" = 1 ] && archive=$OUT
            OUT=$archive "$REPO/scripts/tts_bench/run.sh" http://127.0.0.1:8000 "$count" \
                "${TTS_DURATION:-40s}" > "$OUT/tts-$count-$name.txt" 2>&1
            echo "== $name, tts_bench $count req/s ($tree $flags):"; grep -v "^INFO\|^\[" "$OUT/tts-$count-$name.txt" | tail -25
            continue
        fi
        listen=()
        [ "$kind" = listen ] && listen=(--listen)
        sessions=${count:-256}
        timeout 150 python3 "$REPO/scripts/bench_gateway.py" --url ws://127.0.0.1:8000/v1/tts/stream --sessions $sessions \
            --processes 8 --duration 30 --buffering auto "${listen[@]}" --server-pid $server \
            > "$OUT/ws-$sessions-$kind-$name.json" 2> "$OUT/ws-$sessions-$kind-$name.err"
        echo "== $name, $sessions sessions, $kind ($tree $flags): $(cat "$OUT/ws-$sessions-$kind-$name.json")"
    done
    kill $sampler $tracer $cpu
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode())" \
        > "$OUT/metrics-$name.txt" 2>&1
    echo "== $name: GPU memory used, peak $(sort -n "$OUT/gpu-memory-$name.txt" | tail -1) MiB"
    kill -INT $server
    wait $server
done
