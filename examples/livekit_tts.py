"""Speak through a running `voxgate serve` with the LiveKit Agents plugin: streamed LLM tokens over the socket, and
one request over HTTP; both saved as WAV files.

    python examples/livekit_tts.py [http://localhost:8000] [livekit]

Needs `pip install 'voxgate-client[livekit]'` (clients/python). In an agent it is simply the session's TTS:
`AgentSession(tts=voxgate_client.livekit.TTS(base_url=...), ...)`.
"""
from __future__ import annotations

import asyncio
import sys

from livekit import rtc
from livekit.agents import utils
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

from voxgate_client.livekit import TTS

TOKENS = ["Hello", " from", " a LiveKit", " agent,", " spoken while", " the text arrives."]


async def main(base_url: str, out_prefix: str) -> None:
    async with utils.http_context.open(), TTS(base_url=base_url, sample_rate=24000) as voxgate:
        stream = voxgate.stream()
        for token in TOKENS:  # as an LLM writes them
            stream.push_text(token)
        stream.end_input()
        frames, words = [], []
        async for event in stream:
            frames.append(event.frame)
            words += event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])
        await stream.aclose()
        said = await voxgate.synthesize("And this sentence came over HTTP.").collect()
    streamed = rtc.combine_audio_frames(frames)
    for name, audio in (("stream", streamed), ("http", said)):
        with open(f"{out_prefix}-{name}.wav", "wb") as wav:
            wav.write(audio.to_wav_bytes())
        print(f"wrote {out_prefix}-{name}.wav: {audio.duration:.2f} s of audio")
    print("words:", " ".join(f"{w.strip()}@{w.start_time:.2f}s" for w in words))


if __name__ == "__main__":
    asyncio.run(main(*(sys.argv[1:3] + ["http://localhost:8000", "livekit"][len(sys.argv[1:3]):])))
