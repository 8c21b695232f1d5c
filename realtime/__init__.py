"""voxgate's realtime gateway: the HTTP and WebSocket front of the engine (`voxgate serve`) and its Python client."""
