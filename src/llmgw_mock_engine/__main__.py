from llmgw_mock_engine.engine import cli

cli()
