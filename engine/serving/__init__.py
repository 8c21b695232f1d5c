"""The engine served to asyncio callers: on a thread of the caller's process or in a process of its own."""
