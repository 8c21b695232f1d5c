"""The streaming codec decoder equals the offline decode, whatever the piece sizes, and keeps its state bounded."""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import parse_speech_tokenizer_config
from engine.core.codec_decoding import DecoderPool, _Graph
from engine.model.codec_decoder import CodecDecoder
from engine.synthetic.checkpoints import _randomize
from engine.synthetic.configs import speech_tokenizer_config


@pytest.fixture(scope="module")
def decoder() -> CodecDecoder:
    torch.manual_seed(0)
    module = CodecDecoder(parse_speech_tokenizer_config(speech_tokenizer_config("tiny")).decoder)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in module.named_parameters():
            _randomize(name, param.data, generator)
    return module.eval()


def random_codes(frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, frames, 16), generator=torch.Generator().manual_seed(seed))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@torch.inference_mode()
@pytest.mark.parametrize("piece", [1, 2, 3, 7])
def test_streaming_in_pieces_equals_offline(decoder: CodecDecoder, piece: int) -> None:
    codes = random_codes(100)  # longer than the 72-frame attention window, so the window slides
    offline = decoder.decode(codes)
    assert offline.shape == (1, 100 * 1920)
    assert offline.abs().mean() > 1e-3  # not near-silence: the comparison means something
    state = decoder.new_state()
    pieces = [decoder.decode_step(codes[:, i:i + piece], state) for i in range(0, 100, piece)]
    streamed = torch.cat(pieces, dim=1)
    assert streamed.shape == offline.shape
    assert relative_error(streamed, offline) < 1e-5


@torch.inference_mode()
def test_batched_streams_are_independent(decoder: CodecDecoder) -> None:
    """Streams at different positions decode in one batch exactly as they do alone."""
    a, b = random_codes(30, seed=1), random_codes(30, seed=2)
    alone_a, alone_b = decoder.decode(a), decoder.decode(b)
    state = decoder.new_state(batch=2)
    state_b = decoder.new_state()
    decoder.decode_step(b[:, :5], state_b)  # b starts 5 frames ahead of a
    state.position[1] = state_b.position[0]
    state.history = {k: torch.cat((torch.zeros_like(v), v)) for k, v in state_b.history.items()}
    state.keys = [torch.cat((torch.zeros_like(k), k)) for k in state_b.keys]
    state.values = [torch.cat((torch.zeros_like(v), v)) for v in state_b.values]
    out = decoder.decode_step(torch.cat((a[:, :10], b[:, 5:15])), state)
    assert relative_error(out[0], alone_a[0, : 10 * 1920]) < 1e-5
    assert relative_error(out[1], alone_b[0, 5 * 1920: 15 * 1920]) < 1e-5


@torch.inference_mode()
def test_state_size_does_not_grow(decoder: CodecDecoder) -> None:
    state = decoder.new_state()

    def size() -> int:
        return sum(t.numel() for t in [*state.history.values(), *state.keys, *state.values])

    decoder.decode_step(random_codes(3), state)
    first = size()
    for seed in range(20):
        decoder.decode_step(random_codes(7, seed=seed), state)
    assert size() == first
    assert state.position.item() == 3 + 20 * 7


def test_decoder_cast_under_inference_mode_decodes_as_before(decoder: CodecDecoder) -> None:
    """A copy cast inside inference mode has inference-tensor weights (no version counter): its derived weights (merged
    projections, codebook vectors) are still made from its own weights, and it decodes as the original does."""
    import copy
    codes = random_codes(4)
    with torch.inference_mode():
        expected = decoder.decode(codes)
        cast = copy.deepcopy(decoder).double().float()
        assert cast.quantizer.rvq_first.vq.layers[0]._codebook.embedding_sum.is_inference()
        assert torch.equal(cast.decode(codes), expected)


def test_a_copied_decoder_derives_from_its_own_weights(decoder: CodecDecoder) -> None:
    """A deep copy whose weights then change decodes as a decoder built with those weights, not as the original
    (its merged projections and codebook vectors are made from the copy's weights)."""
    import copy
    codes = random_codes(4)
    with torch.inference_mode():
        decoder.decode(codes)  # the original's derived weights are made
    changed = copy.deepcopy(decoder)
    with torch.no_grad():
        for name, param in changed.named_parameters():
            if name.endswith(("embedding_sum", "q_proj.weight", "gate_proj.weight")):
                param.mul_(0.5)
    fresh = CodecDecoder(decoder.cfg).eval()
    fresh.load_state_dict(changed.state_dict())
    with torch.inference_mode():
        assert torch.equal(changed.decode(codes), fresh.decode(codes))
        assert not torch.equal(changed.decode(codes), decoder.decode(codes))


@torch.inference_mode()
def test_the_fast_path_decodes_as_the_plain_one(decoder: CodecDecoder) -> None:
    """The GPU's way (`use_fast_path`: 2-D convolutions of height 1 on channels-last weights, each residual unit's
    biases moved to the kernels after its convolutions) is the same arithmetic: dilations, groups, strides, biases
    and trimming carried over, streamed in pieces as the engine does. (The kernels themselves: test_fused_kernels.)"""
    codes = random_codes(9, batch=2, seed=4)
    plain = decoder.decode(codes)
    fast = copy.deepcopy(decoder)
    fast.use_fast_path()
    assert any(module.fast_path for module in fast.modules() if hasattr(module, "fast_path"))
    state = fast.new_state(batch=2)
    streamed = torch.cat([fast.decode_step(codes[:, i:i + 4], state) for i in range(0, 9, 4)], dim=1)
    assert relative_error(streamed, plain) < 1e-5
    assert not any(module.fast_path for module in decoder.modules() if hasattr(module, "fast_path"))


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 3), frames=st.integers(1, 5), negatives=st.integers(0, 16), seed=st.integers(0, 2 ** 16),
       bf16=st.booleans())
def test_the_fused_codebook_lookup_is_the_plain_quantizer(decoder: CodecDecoder, batch: int, frames: int,
                                                          negatives: int, seed: int, bf16: bool) -> None:
    """Every codebook's lookup and the two sums in one kernel (run here by the interpreter), negative codes (the
    talker's padding) read as 0: the plain path's bits. In bf16 the codebooks hold small integers, whose sums bf16
    holds exactly: the interpreter truncates each partial sum to bf16 where the GPU rounds it to nearest as the plain
    path does (the GPU's bits on real-size codebooks: docs/benchmarks.md)."""
    quantizer = decoder.quantizer
    if bf16:
        quantizer = copy.deepcopy(quantizer)
        generator = torch.Generator().manual_seed(seed)
        for name, parameter in quantizer.named_parameters():
            if name.endswith("embedding_sum"):
                parameter.data = torch.randint(-8, 9, parameter.shape, generator=generator).float()
            elif name.endswith("cluster_usage"):
                parameter.data = torch.ones_like(parameter)
        quantizer = quantizer.to(torch.bfloat16)
    codes = random_codes(frames, batch, seed)
    codes.view(-1)[torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(seed))[:negatives]] = -1
    with torch.inference_mode():
        plain, fused = quantizer.decode(codes), quantizer.fused_decode(codes)
    assert fused.shape == plain.shape == (batch, decoder.cfg.codebook_dim, frames)
    assert torch.equal(fused, plain)


@torch.inference_mode()
def test_the_fast_paths_fused_transformer_is_the_plain_one(decoder: CodecDecoder) -> None:
    """The pre-transformer's GPU path (`PreTransformer.fused`: LayerScale + residual + RMSNorm, SwiGLU and the window
    attention as Triton kernels, run here by the interpreter) streamed past its window, chunk by chunk, against the
    plain layers: the same outputs and the same states."""
    transformer = decoder.pre_transformer
    latent = torch.randn(2, 90, transformer.input_proj.in_features, generator=torch.Generator().manual_seed(5))
    plain_state, fused_state = decoder.new_state(batch=2), decoder.new_state(batch=2)
    for start in range(0, 90, 4):
        chunk = latent[:, start:start + 4]
        plain = transformer(chunk, plain_state)
        n = chunk.shape[1]
        positions = fused_state.position[:, None] + torch.arange(n)[None]
        fused = transformer.fused(transformer.input_proj(chunk), *transformer.rotary(positions, chunk.dtype),
                                  fused_state)
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
        for cached, expected in zip(fused_state.keys + fused_state.values, plain_state.keys + plain_state.values):
            torch.testing.assert_close(cached, expected, atol=1e-5, rtol=1e-5)
        plain_state.position = plain_state.position + n
        fused_state.position = fused_state.position + n


class _ReplayedInPlace:
    """What a captured decode graph does, run eagerly: the pool's gather-decode-scatter on the graph's static inputs,
    its output written into memory that every graph of the pool shares (as CUDA graphs captured into one pool may:
    any replay can overwrite another graph's output)."""

    def __init__(self, pool: DecoderPool, graph, shared: torch.Tensor) -> None:
        self.pool, self.target = pool, graph
        graph.audio = shared[: graph.slots.shape[0]]

    def replay(self) -> None:
        self.target.audio.copy_(self.pool._decode(self.target.slots, self.target.codes))


class _ReplayedEagerly:
    """What a captured decode graph does, run eagerly: the pool's gather-decode-scatter on the graph's inputs."""

    def __init__(self, pool: DecoderPool, graph) -> None:
        self.pool, self.target = pool, graph

    def replay(self) -> None:
        self.target.audio = self.pool._decode(self.target.slots, self.target.codes)


@torch.inference_mode()
def test_the_eager_pool_gives_the_same_bits_however_the_frames_are_chunked_and_batched(decoder: CodecDecoder) -> None:
    """PROTOCOL.md: the same codes give identical fp32 audio however the text was split (the chunks follow when it
    arrived) and whatever shared the call. Chunks of 1, of 1-3-4-4, of 5-7 and all 12 at once, alone and beside
    another request, bit for bit."""
    codes = random_codes(12, batch=2, seed=5)

    def heard(split: list[int], batched: bool) -> torch.Tensor:
        pool = DecoderPool(decoder, 2, torch.device("cpu"), torch.float32)
        out, at = [], 0
        for frames in split:
            chunk = codes[:, at:at + frames] if batched else codes[:1, at:at + frames]
            out.append(pool.decode([0, 1] if batched else [0], chunk)[0])
            at += frames
        return torch.cat(out)

    alone = heard([1] * 12, batched=False)
    for split in ([1, 3, 4, 4], [5, 7], [12]):
        for batched in (False, True):
            assert torch.equal(heard(split, batched), alone), (split, batched)


@torch.inference_mode()
def test_a_call_past_the_largest_graph_decodes_in_slices_of_it(decoder: CodecDecoder) -> None:
    """More rows than the largest captured bucket: the call runs as slices of that graph (the 256-row graphs cost
    4.8 GiB of the GPU), each slice's audio copied out before a later replay overwrites it, every row's state carried
    on. Against each request decoded alone over two calls."""
    slots, rows, largest = 6, 5, 2
    pool = DecoderPool(decoder, slots, torch.device("cpu"), torch.float32)
    shared = torch.empty(largest, 1920)  # one pool: every graph's output starts at its first row
    for size in (1, 2):
        graph = _Graph.__new__(_Graph)  # its inputs as _Graph makes them; no CUDA graph on the CPU
        graph.slots = torch.full((size,), pool.scratch_slot, dtype=torch.long)
        graph.codes = torch.zeros(size, 1, decoder.cfg.num_quantizers, dtype=torch.long)
        graph.graph = _ReplayedInPlace(pool, graph, shared)
        pool.graphs[(size, 1)] = graph
    alone = DecoderPool(decoder, slots, torch.device("cpu"), torch.float32)
    codes = random_codes(2, batch=rows, seed=3)
    order = [4, 0, 3, 1, 2]  # slots out of order
    for frame in range(2):
        sliced = pool.decode(order, codes[:, frame:frame + 1])
        expected = torch.cat([alone.decode([slot], codes[row:row + 1, frame:frame + 1])
                              for row, slot in enumerate(order)])
        assert sliced.shape == (rows, 1920) and largest < rows
        assert relative_error(sliced, expected) < 1e-5
        for row in range(rows):  # no row holds another's (a slice overwritten by a later replay before it was copied)
            assert relative_error(sliced[row], expected[row]) < 1e-4


@torch.inference_mode()
def test_the_pools_rows_carry_each_slots_state(decoder: CodecDecoder) -> None:
    """A slot's whole state is one row of the pool (`PackedState`), gathered, decoded into a second batch of rows and
    scattered back. Requests decoded together in changing groups (through stand-ins for the GPU's graphs, so that
    they share batches padded onto the scratch slot), slots out of order, past the 72-frame window, and a slot reset
    and reused mid-way: each request hears its offline decode, and a slot's neighbours never leak into it."""
    pool = DecoderPool(decoder, 4, torch.device("cpu"), torch.float32)
    for size in (1, 2, 4):
        for frames in range(1, 6):
            graph = _Graph.__new__(_Graph)  # its inputs as _Graph makes them; no CUDA graph on the CPU
            graph.slots = torch.full((size,), pool.scratch_slot, dtype=torch.long)
            graph.codes = torch.zeros(size, frames, decoder.cfg.num_quantizers, dtype=torch.long)
            graph.graph = _ReplayedEagerly(pool, graph)
            pool.graphs[(size, frames)] = graph
    codes = random_codes(100, batch=4, seed=7)
    slot_of = {0: 2, 1: 0, 2: 3}  # request -> slot; request 3 takes request 0's slot once it is done
    heard: dict[int, list[torch.Tensor]] = {request: [] for request in range(4)}
    cursor = dict.fromkeys(range(4), 0)

    def call(requests: list[int], frames: int) -> None:
        chunk = torch.cat([codes[r:r + 1, cursor[r]:cursor[r] + frames] for r in requests])
        for request, audio in zip(requests, pool.decode([slot_of[r] for r in requests], chunk)):
            heard[request].append(audio)
            cursor[request] += frames

    call([0, 1], 3)
    call([1], 1)
    call([2, 0, 1], 2)
    for _ in range(19):
        call([0, 2, 1], 4)  # 79 frames of request 0: past the window
    call([0], 1)
    pool.reset([slot_of[0]])
    slot_of[3] = slot_of.pop(0)
    call([3, 1], 2)
    call([1, 3], 5)
    for request in range(4):
        frames = cursor[request]
        expected = decoder.decode(codes[request:request + 1, :frames])[0]
        assert frames and relative_error(torch.cat(heard[request]), expected) < 1e-5, request
