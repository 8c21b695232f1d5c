"""Speak an LLM-style reply through a running `voxgate serve` with the Pipecat plugin, and save what the pipeline's
output would have played as a WAV file.

    python examples/pipecat_tts.py [ws://localhost:8000/v1/tts/stream] [pipecat.wav]

Needs `pip install 'voxgate-client[pipecat]'` (clients/python). In a real bot the service sits between the LLM and
the transport's output: `Pipeline([transport.input(), stt, user_aggregator, llm, tts, transport.output(), ...])`.
"""
from __future__ import annotations

import asyncio
import sys
import wave

from pipecat.frames.frames import (
    EndFrame,
    Frame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from voxgate_client.pipecat import VoxgateTTSService

SAMPLE_RATE = 16000
REPLY = ["Sure", "! The weather", " today is sunny,", " with a light breeze."]


class Speaker(FrameProcessor):
    """Stands in for the transport's output: keeps the audio and the words as they would be played."""

    def __init__(self) -> None:
        super().__init__()
        self.pcm, self.words = bytearray(), []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.pcm += frame.audio
        elif isinstance(frame, TTSTextFrame):
            self.words.append(frame.text)
        await self.push_frame(frame, direction)


async def main(url: str, out: str) -> None:
    speaker = Speaker()
    worker = PipelineWorker(Pipeline([VoxgateTTSService(url=url), speaker]),
                            params=PipelineParams(audio_out_sample_rate=SAMPLE_RATE))
    # one LLM reply, then the end of the pipeline (which waits for the reply's audio)
    await worker.queue_frames([LLMFullResponseStartFrame(), *map(LLMTextFrame, REPLY), LLMFullResponseEndFrame(),
                               EndFrame()])
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await runner.run()
    if not speaker.pcm:
        raise SystemExit("no audio came back: is the server running at " + url)
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(SAMPLE_RATE)
        wav.writeframes(bytes(speaker.pcm))
    print(f"wrote {out}: {len(speaker.pcm) / 2 / SAMPLE_RATE:.2f} s of audio; words: {' '.join(speaker.words)}")


if __name__ == "__main__":
    asyncio.run(main(*(sys.argv[1:3] + ["ws://localhost:8000/v1/tts/stream", "pipecat.wav"][len(sys.argv[1:3]):])))
