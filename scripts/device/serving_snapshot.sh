#!/usr/bin/env bash
# On the GPU machine (after `source scripts/device/setup.sh`): where serving stands, in one call of ~8 minutes.
# A random 1.7B CustomVoice checkpoint, one `voxgate serve` with its defaults (--max-sessions 600 so that sessions
# are bounded by the engine's slots, not the session limit), then against it: tts_bench at 1 and 10 req/s (60 s),
# bench_gateway's open loop of WebSocket contexts with LLM-paced text at 10 and 20 req/s (40 s; one client process
# reads ~10,000 audio messages a second, so higher rates measure the client), and 256 closed-loop voice-chat
# sessions (--listen, 30 s). Reports and JSON lines go to $OUT.
set -u
python3 -m realtime.cli make-checkpoint --size 1b7 --variant custom_voice -o /tmp/ck > /dev/null || exit 1
python3 -m realtime.cli serve --model /tmp/ck --device cuda --port 8000 --synthetic-frames-per-token 3.5 \
    --max-sessions 600 > "$OUT/server.log" 2>&1 &
server=$!
for rate in 1 10; do
    timeout 100 scripts/tts_bench/run.sh http://127.0.0.1:8000 $rate 60s 2>&1 \
        | grep -E "Actual RPS|underrun requests|Audible TTFA|peak in-flight"
done
for rate in 10 20; do
    timeout 90 python3 scripts/bench_gateway.py --url ws://127.0.0.1:8000/v1/tts/stream --mode open --traffic ws \
        --rate $rate --duration 40 --server-pid $server > "$OUT/ws-open-$rate.json" 2> "$OUT/ws-open-$rate.err"
    tail -25 "$OUT/ws-open-$rate.err"
done
timeout 120 python3 scripts/bench_gateway.py --url ws://127.0.0.1:8000/v1/tts/stream --sessions 256 --processes 8 \
    --duration 30 --buffering auto --listen --server-pid $server > "$OUT/ws-256-listen.json" 2> "$OUT/ws-256-listen.err"
tail -30 "$OUT/ws-256-listen.err"
kill -INT $server
wait $server
