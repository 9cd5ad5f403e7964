"""Errors raised for bad datasets and inputs: one clear message, no wall of traceback."""

# How a traceback names this class on its last line, before the message.
_TRACEBACK_NAME = "gs_lightning.data.errors.DatasetError: "


class DatasetError(RuntimeError):
    """A dataset root, split or file is missing or malformed.

    The message names the path, what is wrong and the expected layout. Raised in a DataLoader
    worker, it reaches the main process as the same message: torch re-raises it there as
    ``DatasetError("Caught DatasetError in DataLoader worker process N. Original Traceback ...")``,
    and only the original message is kept, as with ``num_workers=0``.
    """

    def __init__(self, message: str) -> None:
        if message.startswith("Caught DatasetError in DataLoader worker") and _TRACEBACK_NAME in message:
            message = message.rsplit(_TRACEBACK_NAME, 1)[1].rstrip("\n")
        super().__init__(message)
