"""The data plane: the OpenAI-compatible front, its upstream pools, balancing, health
probing and metrics. It knows nothing of the control plane: it serves the replica sets
it is given (`Router.set_endpoints`)."""
