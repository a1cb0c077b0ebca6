"""The llmgw server: the OpenAI-compatible router (`router`, the data plane), the control
plane (`control`, its pure core; `control_shell`, the trio shell with the agent streams,
the admin API and the fleet page; `store`, etcd for a highly available one), the route
feed between them (`route_feed`), config reloads (`reload`), each process's wiring
(`wiring`) and the command lines (`__main__`, `admin_cli`, `certs_cli`, `demo`)."""
