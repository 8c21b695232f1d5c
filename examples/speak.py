"""Speak a few pieces of text through a running `voxgate serve` and save the audio as a WAV file.

    python examples/speak.py [ws://localhost:8000/v1/tts/stream] [hello.wav]

The text goes in as an LLM would send it (pieces, spoken while they arrive); the Opus frames that come back are
decoded by `context_audio` (or ask for `preset="pcm"` to get raw PCM)."""
from __future__ import annotations

import asyncio
import sys

import soundfile as sf

from voxgate_client.client import VoxgateClient, context_audio


async def main(url: str, out: str) -> None:
    async with VoxgateClient.connect(url) as client:
        result = await client.speak("greeting", ["Hello ", "there, ", "how are ", "you today?"])
        if result.errors:
            raise SystemExit(f"the server refused the text: {result.errors}")
        audio = context_audio(result, client.session)
        rate = client.session["audio"]["sample_rate"]
    sf.write(out, audio, rate)
    print(f"wrote {out}: {len(audio) / rate:.2f} s of audio, first audio after {result.ttfa_s * 1000:.0f} ms")


if __name__ == "__main__":
    asyncio.run(main(*(sys.argv[1:3] + ["ws://localhost:8000/v1/tts/stream", "hello.wav"][len(sys.argv[1:3]):])))
