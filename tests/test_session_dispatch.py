"""Every voxgate.v1 message type the protocol accepts has exactly one session handler (an explicit table, so a new
message type cannot be validated and then fail to dispatch)."""
from realtime.ws.protocol import MESSAGES
from realtime.ws.session import HANDLERS


def test_every_message_type_has_a_handler():
    assert HANDLERS.keys() == MESSAGES.keys()
