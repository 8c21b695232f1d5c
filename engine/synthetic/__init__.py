"""Random checkpoints, configs and tokenizer files in the official layout, for tests and benchmarks offline."""
