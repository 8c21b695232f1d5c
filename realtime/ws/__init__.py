"""The voxgate.v1 WebSocket room: sessions, their contexts and the wire protocol they speak (docs/PROTOCOL.md)."""
