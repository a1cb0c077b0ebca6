"""The llmgw server: the OpenAI-compatible router (and, later, the control plane)."""
