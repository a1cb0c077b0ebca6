"""The mock engine: an OpenAI-compatible stand-in for vLLM, SGLang and llama.cpp
(`engine`), with an optional model of an engine's scheduler (`scheduler`). Run it with
`python -m llmgw_mock_engine` or `llmgw-mock-engine`; see docs/mock-engine.md."""
