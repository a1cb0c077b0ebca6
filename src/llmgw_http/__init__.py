"""HTTP/1.1 for the data plane and the control port: the server (`server`, a regex fast
path proven against h11), chunked framing (`chunked`), the TLS admission in front of the
control port (`tls_admission`), websockets over the server (`ws_server`), and the
coarse timeouts and socket probes they share. Below the router and the control plane;
above `llmgw_core`. The agent never imports it."""
