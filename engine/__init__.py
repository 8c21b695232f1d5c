"""voxgate's inference engine for Qwen3-TTS: the model, requests, and the batched engine that serves them."""
