"""Errors in a single request; they reject that request and never disturb others."""


class RequestError(ValueError):
    """A request that cannot be served as given (the server answers 400 with this message)."""
