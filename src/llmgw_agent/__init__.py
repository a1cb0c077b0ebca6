"""The llmgw agent: runs on each GPU node, dials the control plane, supervises engines."""
