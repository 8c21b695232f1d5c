#!/usr/bin/env bash
# On the GPU machine (after `source scripts/device/setup.sh`): the gateway's CPU per second of Opus audio on this
# host. bench_opus's per-stream cost of each Opus mode, then 256 closed-loop voice-chat sessions (--listen, 30 s)
# against a `voxgate serve` of this tree and, with BEFORE_TREE (a copy of the repository at another revision), of
# that tree right after it, on the same machine and checkpoint. Reports and JSON to $OUT.
#   scripts/device/gateway_cpu.sh [BEFORE_TREE]
set -u
python3 scripts/bench_opus.py --complexities 0,5 --repeats 3 --threads 1 > "$OUT/opus.json" || exit 1
python3 -m realtime.cli make-checkpoint --size 1b7 --variant custom_voice -o /tmp/ck > /dev/null || exit 1
for tree in "$PWD" ${1:-}; do
    name=$(basename "$tree")
    (cd "$tree" && exec python3 -m realtime.cli serve --model /tmp/ck --device cuda --port 8000 \
        --synthetic-frames-per-token 3.5 --max-sessions 600) > "$OUT/server-$name.log" 2>&1 &
    server=$!
    python3 scripts/device/wait_ready.py http://127.0.0.1:8000 600 || exit 1
    timeout 120 python3 scripts/bench_gateway.py --url ws://127.0.0.1:8000/v1/tts/stream --sessions 256 \
        --processes 8 --duration 30 --buffering auto --listen --server-pid $server \
        > "$OUT/ws-256-listen-$name.json" 2> "$OUT/ws-256-listen-$name.err"
    echo "== $name ($tree)"; tail -30 "$OUT/ws-256-listen-$name.err"
    kill -INT $server
    wait $server
done
