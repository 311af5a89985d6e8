"""Errors a user can act on. Each message is one clear line."""


class PagedChatError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""


class ModelError(PagedChatError):
    """A model could not be found, read, or is of an unsupported kind."""


class PullError(PagedChatError):
    """The default model could not be fetched or converted."""


class RequestError(PagedChatError, ValueError):
    """A request can never run: too long for the context or for the KV cache."""
