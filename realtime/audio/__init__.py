"""Audio out of the gateway: formats, per-context encoders, Ogg Opus and whole files, one job per module."""
