"""`pagedchat serve`: the OpenAI-compatible HTTP API over the one in-process engine (docs/serving.md)."""
