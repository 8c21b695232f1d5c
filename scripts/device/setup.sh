# On the GPU machine, sourced first in every device call (scripts/device/prepare.sh made what it reads):
# libopus where the loader finds it, the carried wheels on PYTHONPATH with the repository and its client.
mkdir -p /tmp/debs && for deb in .debs/*.deb; do dpkg -x "$deb" /tmp/debs; done
cp -a /tmp/debs/usr/lib/x86_64-linux-gnu/libopus.so* /usr/local/lib/ && ldconfig
if [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && touch /tmp/site/.installed || return 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/clients/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import opuslib_next, starlette, uvicorn, websockets, soxr, av, openai" || return 1
