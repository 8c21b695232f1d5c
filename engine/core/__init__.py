"""The engine core: the step loop over the scheduler, the model runner and audio decoding, on slot KV caches."""
