"""Streaming codec-decoder states for every slot, decoded in batches.

Each slot keeps its own exact streaming state (sliding-window K/V, conv histories, position); a decode call gathers
the states of the streams it serves, runs them as one batch and scatters them back, so streams that joined at
different times share one decoder pass and each still hears exactly its offline decode.
"""
from __future__ import annotations

import torch

from engine.model.codec_decoder import CodecDecoder, DecoderState


class DecoderPool:
    def __init__(self, decoder: CodecDecoder, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.decoder = decoder
        template = decoder.new_state(1, device, dtype)
        codes = torch.zeros(1, 1, decoder.cfg.num_quantizers, dtype=torch.long, device=device)
        with torch.inference_mode():
            decoder.decode_step(codes, template)  # creates every conv history, so their shapes are known

        def pooled(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((slots, *t.shape[1:]), dtype=t.dtype, device=device)

        self.state = DecoderState(
            position=torch.zeros(slots, dtype=torch.long, device=device),
            history={name: pooled(t) for name, t in template.history.items()},
            keys=[pooled(t) for t in template.keys],
            values=[pooled(t) for t in template.values],
        )

    def _tensors(self, state: DecoderState) -> list[torch.Tensor]:
        return [state.position, *state.history.values(), *state.keys, *state.values]

    def reset(self, slot: int) -> None:
        for tensor in self._tensors(self.state):
            tensor[slot] = 0

    @torch.inference_mode()
    def decode(self, slots: list[int], codes: torch.Tensor) -> torch.Tensor:
        """codes [B, n, 16] for the streams in `slots` -> waveform [B, n * samples_per_frame]."""
        index = torch.tensor(slots, device=codes.device)
        state = DecoderState(
            position=self.state.position[index],
            history={name: t[index] for name, t in self.state.history.items()},
            keys=[t[index] for t in self.state.keys],
            values=[t[index] for t in self.state.values],
        )
        audio = self.decoder.decode_step(codes, state)
        for pool, updated in zip(self._tensors(self.state), self._tensors(state)):
            pool[index] = updated
        return audio
