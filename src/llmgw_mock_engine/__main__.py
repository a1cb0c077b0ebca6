from llmgw_mock_engine.cli import cli

cli()
