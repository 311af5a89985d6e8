"""`pagedchat serve`: the OpenAI-compatible HTTP API over the one in-process engine (see README "Serving")."""
