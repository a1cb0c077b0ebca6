"""A close frame's reason fits the frame (RFC 6455 5.5) whatever a node's name holds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from wsproto.frame_protocol import CloseReason, FrameProtocol

from llmgw_http.ws_server import MAX_CLOSE_REASON_BYTES, close_frame_reason


@given(st.text())
def test_a_reason_is_cut_on_a_character_boundary_to_what_a_frame_carries(reason: str) -> None:
    cut = close_frame_reason(reason)
    assert len(cut.encode()) <= MAX_CLOSE_REASON_BYTES
    assert reason.startswith(cut)
    if len(reason.encode()) <= MAX_CLOSE_REASON_BYTES:
        assert cut == reason
    # wsproto sends it (a longer payload is refused before it reaches the socket)
    FrameProtocol(client=False, extensions=[]).close(CloseReason.POLICY_VIOLATION, cut)


def test_a_node_name_of_three_byte_characters_is_not_cut_mid_character() -> None:
    reason = "node " + "名" * 60 + " is connected"
    assert close_frame_reason(reason) == "node " + "名" * 39
