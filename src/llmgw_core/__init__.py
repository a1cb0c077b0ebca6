"""What both llmgw daemons share: the catalog, configuration, and the HTTP/1.1 plumbing."""

__version__ = "0.1.0"
