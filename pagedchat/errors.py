"""Errors a user can act on. Each message is one clear line."""


class PagedChatError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""


class ModelError(PagedChatError):
    """A model could not be found, read, or is of an unsupported kind."""


class PullError(PagedChatError):
    """The default model could not be fetched or converted."""


class RequestError(PagedChatError, ValueError):
    """A request can never run: too long for the context or for the KV cache."""


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (its type name where it has none), for a one-line error."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
