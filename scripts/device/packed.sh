#!/usr/bin/env bash
# On the GPU machine: runs a command with $OUT set to a scratch folder, and packs that folder into one archive,
# $OUT/all.tgz of the call, every 15 s and at the end. The device tool returns only so many files from $OUT (a call
# whose loads wrote dozens returned none of their reports), and a call cut at its time limit returns what was packed
# last.   Usage: bash scripts/device/packed.sh COMMAND [ARGS...]   (unpack with `tar xzf all.tgz`)
set -uo pipefail
if [ $# -lt 1 ] || [ -z "${OUT:-}" ]; then
    sed -n '2,5p' "$0" >&2
    exit 2
fi
archive=$OUT/all.tgz
OUT=$(mktemp -d)
export OUT
pack() {
    tar czf "$archive.part" -C "$OUT" . 2>/dev/null && mv "$archive.part" "$archive"
}
(while sleep 15; do pack; done) &
packer=$!
"$@"
status=$?
kill "$packer" 2>/dev/null
wait "$packer" 2>/dev/null
pack
exit $status
