"""What agents and the control port agree on about the agents' lane: the ALPN name an
agent offers, how long it waits for its dial, and how long the port may queue it. Both
ends read it here, so the port's admission needs nothing of the dialer."""

# Offered by agents in their ClientHello: the control port admits them on a lane of their
# own (llmgw_http.tls_admission).
AGENT_ALPN = b"llmgw-agent"

# How long an agent waits for its dial to be answered: the TCP connect, the TLS handshake
# and the websocket handshake together. A control plane that a whole fleet dials at once
# (its first start, a restart) serves agents' connections in the order they came, within
# a deadline it can meet (llmgw_http.tls_admission): an agent that waits its turn is
# registered with one handshake, where one that gave up sooner dialled again, each time
# at the back of the queue (issue 17: 4 to 9 attempts a node at 10,000 nodes).
AGENT_DIAL_PATIENCE_S = 45.0
# Of that, how long the control port may keep an agent's connection queued for its TLS
# handshake, counted from its arrival in the server's kernel; the rest leaves room for
# the TCP connect's retries, the handshakes and the answer to the websocket handshake.
AGENT_QUEUE_S = 30.0
