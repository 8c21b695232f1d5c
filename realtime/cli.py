"""The `voxgate` command: `serve` (the realtime gateway), `synth` (one utterance to a WAV file) and
`make-checkpoint` (random checkpoints)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from engine.errors import VoxgateError

DEFAULT_SYSTEM_PROMPT = ("You are a helpful voice assistant. Your answers are spoken aloud: keep them short and "
                         "conversational, in plain sentences without lists, markdown or emoji.")


def _synth_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="synthesize one utterance into a WAV file")
    p.add_argument("--model", help="checkpoint directory or hub id (default: the embedded tiny model)")
    p.add_argument("--text", required=True)
    p.add_argument("--speaker", help="built-in speaker (CustomVoice)")
    p.add_argument("--instruct", help="voice / style instruction (VoiceDesign, CustomVoice 1.7B)")
    p.add_argument("--ref-audio", type=Path, help="reference audio to clone (Base)")
    p.add_argument("--ref-text", help="transcript of the reference audio (Base, ICL mode)")
    p.add_argument("--x-vector-only", action="store_true", help="clone from the speaker embedding alone")
    p.add_argument("--language", default="auto", help="language name or ISO code, or auto (default)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding for the talker and code predictor")
    p.add_argument("--seed", type=int, help="seed for sampling")
    p.add_argument("--max-frames", type=int, help="at most this many 80 ms frames (replaces the runaway guard)")
    p.add_argument("--text-layout", choices=["prefill", "streaming"], help="default: the reference's per mode")
    p.add_argument("--synthetic-frames-per-token", type=float, metavar="X",
                   help="benchmark-only, random-weight checkpoints: exactly ceil(X x text tokens) frames (default off)")
    p.add_argument("--codes-out", type=Path, help="also write the codes as an int array [frames, 16] (.npy)")
    p.add_argument("--device", default="cpu")
    p.add_argument("-o", "--output", type=Path, required=True, help="output WAV file")
    p.set_defaults(run=run_synth)


def _checkpoint_parser(sub: argparse._SubParsersAction) -> None:
    from engine.synthetic.configs import SIZES, VARIANTS

    p = sub.add_parser("make-checkpoint", help="write a random checkpoint in the official layout")
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--variant", choices=VARIANTS, default="custom_voice")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", type=Path, required=True, help="output directory")
    p.set_defaults(run=run_make_checkpoint)


def run_synth(args: argparse.Namespace) -> None:
    import numpy as np
    import soundfile as sf

    from engine.config import load_model_config
    from engine.model_source import resolve_model
    from engine.request import SyntheticLength
    from engine.sampling import SamplingParams
    from engine.synthetic.checkpoints import default_model_dir
    from engine.tts import TTSModel, VoiceRequest

    if args.max_frames is not None and args.max_frames < 1:
        raise VoxgateError("--max-frames must be at least 1")
    model_dir, _ = resolve_model(args.model or default_model_dir())
    length = (None if args.synthetic_frames_per_token is None else
              SyntheticLength.for_model(args.synthetic_frames_per_token, load_model_config(model_dir), str(model_dir),
                                        "--synthetic-frames-per-token"))
    started = time.perf_counter()
    tts = TTSModel.load(model_dir, device=args.device)
    speaker = args.speaker
    if speaker is None and tts.model_type == "custom_voice" and args.model is None:
        speaker = "vivian"
    voice = tts.voice(VoiceRequest(speaker=speaker, instruct=args.instruct, ref_audio=args.ref_audio,
                                   ref_text=args.ref_text, x_vector_only=args.x_vector_only))
    sampling = SamplingParams.from_defaults(tts.config.generation, greedy=args.greedy, seed=args.seed)
    result = tts.synthesize(args.text, voice, language=args.language, layout=args.text_layout,
                            sampling=sampling, max_frames=args.max_frames, length=length)
    sf.write(args.output, result.audio, result.sample_rate, subtype="PCM_16")
    if args.codes_out:
        np.save(args.codes_out, result.codes.numpy().astype(np.int64))
    seconds = len(result.audio) / result.sample_rate
    print(f"wrote {args.output}: {result.codes.shape[0]} frames, {seconds:.2f} s of audio "
          f"in {time.perf_counter() - started:.1f} s", file=sys.stderr)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from realtime.gateway import GPU_BUSY_BATCH, GPU_LEAD_TARGET_S, Limits
    from realtime.voice_store import default_data_dir

    d = Limits()
    p = sub.add_parser("serve", help="run the realtime gateway (WebSocket voxgate.v1 and HTTP)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="checkpoint directory or hub id (default: the embedded tiny model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="debug adds each WebSocket connection's open, accepted and closed lines")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted API key (repeatable; with $VOXGATE_API_KEYS and --api-key-file; none: open)")
    p.add_argument("--api-key-file", type=Path,
                   help="accepted API keys, one a line (# comments): keeps them out of `ps`")
    p.add_argument("--max-sessions", type=int,
                   help="open WebSocket sessions (default: one per engine slot, at least 64; the log and /ready say "
                        "how many)")
    p.add_argument("--max-sessions-per-key", type=int,
                   help="open WebSocket sessions one API key may hold (default: no limit of its own), so that one "
                        "tenant cannot take every session; needs API keys")
    p.add_argument("--max-contexts", type=int, default=d.max_contexts, help="open contexts per session")
    p.add_argument("--max-text-chars", type=int, default=d.max_text_chars, help="text per context")
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="a socket message or HTTP body")
    p.add_argument("--max-message-rate", type=float, default=d.max_message_rate, help="messages/s per session")
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s, help="seconds")
    p.add_argument("--handshake-timeout", type=float, default=d.handshake_timeout_s,
                   help="seconds a connection has to send a request's headers (or its WebSocket handshake)")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections, HTTP and WebSocket (None: 2 x --max-sessions + 64); above --max-sessions")
    p.add_argument("--send-queue-ms", type=int, default=d.send_queue_ms,
                   help="audio queued per session before its synthesis pauses")
    p.add_argument("--clone-voice", action="append", default=[], metavar="NAME=WAV[:TRANSCRIPT]",
                   help="a voice cloned from a reference audio (Base models; repeatable)")
    p.add_argument("--openai-voice", action="append", default=[], metavar="NAME=VOICE",
                   help="the model's voice for one of OpenAI's voice names on POST /v1/audio/speech (alloy=vivian; "
                        "repeatable; GET /v1/voices shows the mapping)")
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help="where the voice library (POST /v1/audio/voices) is stored; the default is "
                        "$XDG_DATA_HOME/voxgate, or ~/.local/share/voxgate")
    p.add_argument("--max-voice-upload-bytes", type=int, default=d.max_voice_upload_bytes,
                   help="a voice upload's body (reference audio and fields)")
    p.add_argument("--max-stored-voices", type=int, default=d.max_stored_voices,
                   help="the voice library's voices per checkpoint")
    p.add_argument("--allowed-origin", action="append", default=[], help="browser Origin allowed (none: any)")
    p.add_argument("--max-batch", type=int, help="engine slots (default on a GPU: as many as 85%% of its free memory "
                        "holds, less whatever would leave under 12 GiB free, a CUDA graph's batch size up to 256: "
                        "256 on an 80 GB H100; 8 on the CPU)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--engine-process", choices=["auto", "on", "off"], default="auto",
                   help="run the engine in its own process (auto: on a GPU), away from the gateway's threads")
    p.add_argument("--llm-url", help="OpenAI-compatible API base for the demo's chat (e.g. http://localhost:11434/v1)")
    p.add_argument("--llm-model", help="the model name sent to --llm-url")
    p.add_argument("--llm-api-key", help="API key for --llm-url (or $VOXGATE_LLM_API_KEY)")
    p.add_argument("--llm-system-prompt", default=DEFAULT_SYSTEM_PROMPT)
    p.add_argument("--synthetic-frames-per-token", type=float, metavar="X",
                   help="benchmark-only: each utterance ends at exactly ceil(X x its text tokens) frames (a random-"
                        "weight checkpoint never emits EOS); refused for a checkpoint not marked random; None: off")
    p.add_argument("--chunk-schedule",
                   help="audio chunk sizes: fixed (1, 1, 2, 4 frames) or lead (by each client's buffer); "
                        "default: lead on a GPU, fixed on the CPU")
    p.add_argument("--admission",
                   help="all (every ready request is prefilled at once) or protect (a prefill waits, at most "
                        "0.1 s, while a running stream's buffer is thin); default: all")
    p.add_argument("--busy-batch", type=int, metavar="N",
                   help="in an engine step of more than N requests a new HTTP stream's first chunk waits for a "
                        "second frame (slack for its client's reads, for one step of time to first audio; WebSocket "
                        "contexts keep one frame: their players buffer); N at least the "
                        f"engine's slots: never; default: {GPU_BUSY_BATCH} on a GPU, never on the CPU")
    p.add_argument("--lead-target", type=float, metavar="S",
                   help="a WebSocket context whose audio is S seconds ahead of its client's playback holds while "
                        "the engine is busy (more than --busy-batch requests run; at any load without one) and no "
                        "request waits for a slot "
                        "(less audio far ahead for the gateway in a burst); 0: never; default: "
                        f"{GPU_LEAD_TARGET_S:g} on a GPU, never on the CPU")
    p.add_argument("--encoder-workers", type=int,
                   help="processes that encode the sockets' audio (Opus, resampling) beside the event loop "
                        "(default: half the cores, 1 to 8)")
    p.set_defaults(run=run_serve)


def _check_scheduling(chunk_schedule: str | None, admission: str | None, lead_target_s: float | None) -> None:
    """The engine's names, checked here (its modules import torch, which `voxgate --help` does not wait for)."""
    from engine.core.decoding import CHUNK_SCHEDULES
    from engine.core.scheduler import ADMISSIONS

    if chunk_schedule is not None and chunk_schedule not in CHUNK_SCHEDULES:
        raise VoxgateError(f"--chunk-schedule {chunk_schedule!r}: choose one of {', '.join(CHUNK_SCHEDULES)}")
    if admission is not None and admission not in ADMISSIONS:
        raise VoxgateError(f"--admission {admission!r}: choose one of {', '.join(ADMISSIONS)}")
    if lead_target_s is not None and not lead_target_s >= 0:
        raise VoxgateError(f"--lead-target {lead_target_s:g}: a number of seconds, 0 (never) or more")


def run_serve(args: argparse.Namespace) -> int:
    """The gateway until it stops; a non-zero status when it failed for good (the model did not load)."""
    from realtime.gateway import MIN_SESSIONS, GatewayOptions, Limits
    from realtime.llm import LLMConfig
    from realtime.server import serve
    from realtime.voices import CloneVoice, parse_openai_voice

    for name in ("max_sessions", "max_sessions_per_key", "max_contexts", "max_text_chars", "max_message_bytes",
                 "send_queue_ms", "max_voice_upload_bytes", "max_stored_voices", "encoder_workers", "max_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise VoxgateError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.port <= 65535:
        raise VoxgateError(f"--port {args.port}: a port is 0 to 65535")
    if args.busy_batch is not None and args.busy_batch < 0:
        raise VoxgateError("--busy-batch must be at least 0")
    if args.idle_timeout <= 0 or args.max_message_rate <= 0 or args.handshake_timeout <= 0:
        raise VoxgateError("--idle-timeout, --handshake-timeout and --max-message-rate must be positive")
    _check_scheduling(args.chunk_schedule, args.admission, args.lead_target)
    try:
        clones = tuple(CloneVoice.parse(spec) for spec in args.clone_voice)
        openai_voices = tuple(parse_openai_voice(spec) for spec in args.openai_voice)
    except ValueError as failure:
        raise VoxgateError(str(failure)) from None
    limits = Limits(args.max_sessions, args.max_contexts, args.max_text_chars, args.max_message_bytes,
                    args.idle_timeout, args.send_queue_ms, args.max_message_rate, api_keys(args),
                    tuple(args.allowed_origin), args.handshake_timeout, args.max_connections,
                    max_voice_upload_bytes=args.max_voice_upload_bytes, max_stored_voices=args.max_stored_voices,
                    max_sessions_per_key=args.max_sessions_per_key)
    if limits.max_sessions_per_key is not None and not limits.api_keys:
        raise VoxgateError("--max-sessions-per-key needs API keys (--api-key, $VOXGATE_API_KEYS or --api-key-file): "
                           "an open gateway's sessions present none")
    if limits.max_connections is not None and limits.max_connections <= (limits.max_sessions or MIN_SESSIONS):
        raise VoxgateError("--max-connections must be more than --max-sessions")
    if bool(args.llm_url) != bool(args.llm_model):
        raise VoxgateError("--llm-url and --llm-model go together")
    llm_key = args.llm_api_key or os.environ.get("VOXGATE_LLM_API_KEY") or None
    llm = LLMConfig(args.llm_url, args.llm_model, llm_key, args.llm_system_prompt) if args.llm_url else None
    options = GatewayOptions(args.model, args.device, clones, limits, args.max_batch, llm=llm, dtype=args.dtype,
                             engine_process={"auto": None, "on": True, "off": False}[args.engine_process],
                             synthetic_frames_per_token=args.synthetic_frames_per_token, openai_voices=openai_voices,
                             data_dir=args.data_dir, chunk_schedule=args.chunk_schedule, admission=args.admission,
                             busy_batch=args.busy_batch, encoder_workers=args.encoder_workers,
                             lead_target_s=args.lead_target)
    try:
        return serve(options, args.host, args.port, args.log_level)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown: that is a normal stop
        return 0


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key, $VOXGATE_API_KEYS and --api-key-file merged (realtime/auth.py)."""
    from realtime.auth import KeyFileError, load_api_keys

    try:
        return load_api_keys(args.api_key, args.api_key_file)
    except KeyFileError as failure:
        raise VoxgateError(str(failure)) from None


def run_make_checkpoint(args: argparse.Namespace) -> None:
    from engine.synthetic.checkpoints import write_random_checkpoint

    if args.output.exists() and not args.output.is_dir():
        raise VoxgateError(f"-o {args.output}: a file is there; a checkpoint is a directory")
    try:
        write_random_checkpoint(args.output, args.size, args.variant, seed=args.seed)
    except OSError as failure:
        raise VoxgateError(f"cannot write the checkpoint to {args.output}: {failure.strerror or failure}") from None
    print(f"wrote a random {args.size} {args.variant} checkpoint to {args.output}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voxgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _synth_parser(sub)
    _checkpoint_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except VoxgateError as exc:
        print(f"voxgate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
