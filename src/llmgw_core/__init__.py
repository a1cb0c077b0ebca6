"""The shared vocabulary at the bottom of every llmgw package (the server, the agent, the
mock engine and `llmgw_http` stand on it; it imports none of them): the config file and
its sections, the model catalog and the engines it names; the agent stream's messages
(`wire`, `inventory`) and the tagged JSON frames both streams read; dialling the control
plane and what a TLS failure tells the user; bearer tokens, certificates, KV-cache
events, traffic reports; and small pure helpers: the Prometheus text format, OpenAI-style
errors, peers' words in the log, rate-limited log lines, durations in words, a token
bucket, awake time."""

__version__ = "0.1.0"
