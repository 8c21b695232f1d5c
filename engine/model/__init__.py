"""The Qwen3-TTS model in PyTorch: talker, code predictor, codec decoder and the encoders of a reference voice."""
