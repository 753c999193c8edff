"""Errors of the compute layer, rooted at ``OmniflowError``.

OmniflowError
└── EngineError           an engine could not load a model or serve a request
    ├── ModelLoadError        a model directory is missing, malformed or unsupported
    ├── RequestError          a GenerateRequest is invalid (also a ValueError)
    └── EngineProcessError    the engine's own process is gone (executor="process")
"""

from __future__ import annotations

from omniflow._exceptions import OmniflowError

__all__ = ["EngineError", "EngineProcessError", "ModelLoadError", "RequestError"]


class EngineError(OmniflowError):
    """An engine failed to load or to serve a request.

    >>> EngineError("engine 'tiny': not started; await engine.start() first").args[0][:6]
    'engine'
    """


class ModelLoadError(EngineError):
    """A model directory could not be loaded; ``path`` names the file at fault, ``field`` the
    config field and ``tensor`` the checkpoint tensor it cannot honour.

    >>> ModelLoadError("config.json: missing field 'vocab_size'", path="m/config.json").path
    'm/config.json'
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        field: str | None = None,
        tensor: str | None = None,
    ) -> None:
        super().__init__(message)
        #: The file or directory concerned.
        self.path = path
        #: The ``config.json`` field whose value is refused (None: not a config value).
        self.field = field
        #: The checkpoint tensor that is unexpected, missing or misshapen (None: not a tensor).
        self.tensor = tensor


class RequestError(EngineError, ValueError):
    """A ``GenerateRequest`` or its ``SamplingParams`` is invalid; ``field`` names the culprit.

    >>> RequestError("top_p must be in (0, 1]", field="sampling.top_p").field
    'sampling.top_p'
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        #: The request field at fault.
        self.field = field


class EngineProcessError(EngineError):
    """The process an engine runs its forward pass in is gone (killed, out of memory, crashed);
    the engine fails every request it holds and refuses new ones until it is restarted.

    >>> isinstance(EngineProcessError("the engine process exited with code -9"), EngineError)
    True
    """
