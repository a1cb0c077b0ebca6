"""The route feed: how the control plane tells routers where each model's replicas are,
and how routers tell it what they still carry. `messages` (the frames and their one
converter), `ws` (a websocket carrying them), `hub` (the control plane's side),
`follower` (a router's side)."""
