"""HTTP/1.1 for the data plane and the control port. Below the router and the control
plane; above `llmgw_core`. The agent never imports it.

- `h1`: the framing of both sides as plain functions over bytes (one grammar: the
  request fast path, the heads written, engine answers, chunk lines); `chunked` scans
  chunked bodies with it; `request` is what a handler is given.
- `server` (listeners, TLS, shutdown) serves each connection by the plain parser
  (`plain_connection`, the fast path, proven against h11) or by h11
  (`h11_connection`), through one serve loop and error policy (`serving`, which also
  holds what a connection reads of its server and reports to it: the connections never
  import `server`) and one responder protocol with a class per mode (`responder`),
  under `limits`.
- `transport`: the router's engine client's connect seam (TCP, or memory streams).
- `tls_admission` (who may begin a TLS handshake on the control port), `ws_server`
  (websockets over the server), and what they share: `coarse_timeouts` on a
  `timer_wheel`, and `sockio` (socket reads and writes without trio's per-call pass).
"""
