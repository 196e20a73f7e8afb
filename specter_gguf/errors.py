"""The one exception type a user may see: its message names the problem and the fix, on one line."""


class SpecterError(Exception):
    """A problem with the user's input or environment, reported without a traceback by the CLI."""


class TemplateError(SpecterError):
    """A chat template failed to render (any error, its time or output limit)."""


class ContextFullError(SpecterError):
    """A prompt (in a chat: the whole conversation) does not fit the model's context."""
