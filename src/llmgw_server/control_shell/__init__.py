"""The control plane's trio shell: agent streams (`agents`), the admin API (`admin`) and
the service that feeds the pure core in `llmgw_server.control` and carries out its
commands (`controlplane`). Imports go one way: `controlplane` -> `agents`, never back."""
