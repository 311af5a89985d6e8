"""Where replies come from: one interface (base.Backend) with two implementations, the in-process engine
(local.LocalBackend) and any OpenAI-compatible server (remote.RemoteBackend)."""
