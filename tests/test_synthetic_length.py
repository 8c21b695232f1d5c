"""`EngineConfig.synthetic_frames_per_token` (benchmark-only): on a random-weight checkpoint each request makes exactly
ceil(X x its text tokens) frames, whole text or streaming text alike, and ends with reason "length"; a checkpoint
not marked as random weights refuses it (tiny real checkpoints, CPU)."""
import json
import math
import random
import shutil
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import RANDOM_WEIGHTS_KEY, GenerationDefaults
from engine.core.engine import Engine, EngineConfig
from engine.errors import BenchmarkOnlyError
from engine.request import AudioChunk, Finished, SynthesisRequest, SyntheticLength
from engine.sampling import SamplingParams
from engine.text.cleanup import speakable
from engine.tts import TTSModel, VoiceRequest

TEXTS = st.text(st.characters(categories=["L", "N", "P", "Zs"], max_codepoint=0x9FFF), min_size=1,
                max_size=16).filter(speakable)  # punctuation alone is empty text


@pytest.fixture(scope="module")
def tts(tiny_checkpoints, one_thread) -> TTSModel:
    return TTSModel.load(tiny_checkpoints["custom_voice"])


def expected_frames(x: float, text_tokens: int) -> int:
    """ceil(X x tokens) with X as written (0.1 x 30 is 3, whatever binary rounding says)."""
    return math.ceil(Fraction(repr(x)) * text_tokens)


def request(tts: TTSModel, text: str, *, complete: bool, seed: int = 5, frames: int | None = None) -> SynthesisRequest:
    return SynthesisRequest(text, tts.voice(VoiceRequest(speaker="ryan")), language="english",
                            layout=None if complete else "streaming", max_frames=frames, text_complete=complete,
                            sampling=SamplingParams.from_defaults(tts.config.generation, seed=seed))


def drain(engine: Engine, audio: dict[int, int], finished: dict[int, Finished]) -> None:
    """One step's events: samples so far per request, and the Finished ones."""
    for event in engine.step():
        if isinstance(event, AudioChunk):
            assert event.start_sample == audio.get(event.request_id, 0)
            audio[event.request_id] = event.start_sample + len(event.samples)
        else:
            finished[event.request_id] = event


def split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(x=st.floats(0.1, 3.0) | st.sampled_from([0.1, 0.5, 1.0, 2.5]), text=TEXTS, seed=st.integers(0, 2**16))
def test_each_request_makes_exactly_ceil_x_tokens_frames(tts, x, text, seed):
    """A whole text and the same text arriving in pieces (steps in between), side by side in one engine."""
    rng = random.Random(seed)
    tokens = len(tts.tokenizer.target(text)[1])
    engine = Engine(tts, EngineConfig(max_batch=2, capacity=256, synthetic_frames_per_token=x))
    pieces = split(text, rng)
    whole = engine.submit(request(tts, text, complete=True))
    stream = engine.submit(request(tts, pieces.pop(0), complete=False))
    audio: dict[int, int] = {}
    finished: dict[int, Finished] = {}
    for piece in pieces:
        for _ in range(rng.randint(0, 2)):
            drain(engine, audio, finished)
        engine.append_text(stream, piece)
    ran_ahead = engine.running[stream].frames if stream in engine.running else 0
    engine.end_text(stream)
    while not engine.idle():
        drain(engine, audio, finished)
    exact = expected_frames(x, tokens)
    assert (finished[whole].reason, finished[whole].frames) == ("length", exact)
    # streaming text holds on its text, so a stream can only have run past its length when X < 1 and its end is late
    assert finished[stream].reason == "length" and finished[stream].frames == max(exact, ran_ahead)
    if x >= 1 or ran_ahead == 0:
        assert finished[stream].frames == exact
    for request_id, event in finished.items():
        assert audio.get(request_id, 0) == event.frames * tts.decoder.samples_per_frame


def test_a_stream_that_ran_past_its_length_ends_at_its_end_of_text_with_all_its_audio(tts):
    engine = Engine(tts, EngineConfig(max_batch=1, capacity=256, chunk_frames=4, synthetic_frames_per_token=0.25))
    text = "One two three four five six seven eight nine ten."
    stream = engine.submit(request(tts, text, complete=False))
    audio: dict[int, int] = {}
    finished: dict[int, Finished] = {}
    while engine.has_work():
        drain(engine, audio, finished)
    ran_ahead = engine.running[stream].frames
    tokens = len(tts.tokenizer.target(text)[1])
    assert ran_ahead > expected_frames(0.25, tokens)  # it held at the end of its text, past its length
    engine.end_text(stream)
    while not engine.idle():
        drain(engine, audio, finished)
    assert (finished[stream].reason, finished[stream].frames) == ("length", ran_ahead)
    assert audio[stream] == ran_ahead * tts.decoder.samples_per_frame
    assert engine.free_slots == [0]


def test_an_explicit_max_frames_still_wins_when_smaller(tts):
    engine = Engine(tts, EngineConfig(max_batch=2, capacity=256, synthetic_frames_per_token=3.0))
    text = "A sentence of several tokens."
    ids = [engine.submit(request(tts, text, complete=True, frames=4)),
           engine.submit(request(tts, text, complete=False, frames=5))]
    engine.end_text(ids[1])
    audio: dict[int, int] = {}
    finished: dict[int, Finished] = {}
    while not engine.idle():
        drain(engine, audio, finished)
    assert [finished[i].frames for i in ids] == [4, 5] and {finished[i].reason for i in ids} == {"length"}


def test_the_benchmark_setting_bans_eos():
    """EOS would end a request before its length: the setting bans it for the whole request."""
    sampling = SyntheticLength(1.5).sampling(SamplingParams.from_defaults(GenerationDefaults()))
    assert sampling.min_new_frames == 2**31 - 1


@pytest.mark.parametrize("x", [0.0, -1.0, float("nan"), float("inf")])
def test_a_non_positive_or_non_finite_setting_is_refused(tts, x):
    with pytest.raises(BenchmarkOnlyError, match="synthetic_frames_per_token must be a positive finite number"):
        Engine(tts, EngineConfig(max_batch=1, capacity=64, synthetic_frames_per_token=x))


def test_a_checkpoint_not_marked_random_refuses_the_setting(tiny_checkpoints, tmp_path):
    unmarked = tmp_path / "unmarked"
    shutil.copytree(tiny_checkpoints["custom_voice"], unmarked)
    config = json.loads((unmarked / "config.json").read_text())
    assert config.pop(RANDOM_WEIGHTS_KEY) is True  # what make-checkpoint writes
    (unmarked / "config.json").write_text(json.dumps(config))
    model = TTSModel.load(unmarked)
    assert not model.config.random_weights
    with pytest.raises(ValueError, match=f"benchmark-only .*{RANDOM_WEIGHTS_KEY}.*{unmarked} is not marked"):
        Engine(model, EngineConfig(max_batch=1, capacity=64, synthetic_frames_per_token=2.0))
    Engine(model, EngineConfig(max_batch=1, capacity=64))  # without it, the same checkpoint serves as before
