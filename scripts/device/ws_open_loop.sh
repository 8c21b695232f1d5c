#!/usr/bin/env bash
# On the GPU machine (after `source scripts/device/setup.sh`): WebSocket contexts with LLM-paced text in an open loop
# against one `voxgate serve` with its defaults, and tts_bench at 1 req/s beside them.
#   scripts/device/ws_open_loop.sh "RATES" [OTHER_BENCH_GATEWAY.py]
# With OTHER_BENCH_GATEWAY, each rate also runs that copy of the load generator (another revision's) right after
# this one's, against the same server. Reports go to $OUT.
set -u
rates=$1 other=${2:-}
python3 -m realtime.cli make-checkpoint --size 1b7 --variant custom_voice -o /tmp/ck > /dev/null || exit 1
python3 -m realtime.cli serve --model /tmp/ck --device cuda --port 8000 --synthetic-frames-per-token 3.5 \
    --max-sessions 600 > "$OUT/server.log" 2>&1 &
server=$!
timeout 200 scripts/tts_bench/run.sh http://127.0.0.1:8000 1 60s 2>&1 \
    | grep -E "Actual RPS|underrun requests|Audible TTFA|peak in-flight"
for rate in $rates; do
    for generator in scripts/bench_gateway.py $other; do
        name=ws-open-$rate-$(basename "$generator" .py)
        timeout 100 python3 "$generator" --url ws://127.0.0.1:8000/v1/tts/stream --mode open --traffic ws \
            --rate "$rate" --duration 40 --server-pid $server > "$OUT/$name.json" 2> "$OUT/$name.err"
        echo "== $name"; tail -12 "$OUT/$name.err"
    done
done
kill -INT $server
wait $server
