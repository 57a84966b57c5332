"""Errors attnforge raises. Each message names the problem so a user can act on it."""


class AttnforgeError(Exception):
    """Base class of every error attnforge raises on purpose."""


class InvalidInputError(AttnforgeError, ValueError):
    """The tensors or arguments given to attention() or explain() are not a valid problem."""


class UnknownNameError(AttnforgeError, KeyError):
    """A backend, device profile or dtype name that attnforge does not know."""

    def __str__(self) -> str:  # KeyError would repr() the message and add quotes
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(AttnforgeError, RuntimeError):
    """No backend (or the forced one) can serve the problem; the message lists every reason."""
