"""Text into token ids: the checkpoint's tokenizer, cleanup of LLM output, and text that arrives in pieces."""
