#!/usr/bin/env bash
# On the GPU machine (after `source scripts/device/setup.sh`): the gateway's CPU per second of Opus audio on this
# host. bench_opus's per-stream cost of each Opus mode, then 256 closed-loop voice-chat sessions (`ws_sessions.sh
# listen`) against a `voxgate serve` of this tree and, with BEFORE_TREE (a copy of the repository at another
# revision), of that tree right after it, on the same machine and checkpoint. Reports and JSON to $OUT.
#   scripts/device/gateway_cpu.sh [BEFORE_TREE]
set -u
python3 scripts/bench_opus.py --complexities 0,5 --repeats 3 --threads 1 > "$OUT/opus.json" || exit 1
configurations=("after=")
[ -n "${1:-}" ] && configurations+=("before@$1=")
bash "$(dirname "$0")/ws_sessions.sh" listen "${configurations[@]}"
