"""The voxgate client: `voxgate_client.client` (the voxgate.v1 socket), `voxgate_client.protocol` (the wire format),
and the framework plugins `voxgate_client.pipecat` (extra `[pipecat]`) and `voxgate_client.livekit` (`[livekit]`).
It needs neither torch nor the server."""
