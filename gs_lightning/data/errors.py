"""Errors raised for bad datasets and inputs: one clear message, no wall of traceback."""


class DatasetError(RuntimeError):
    """A dataset root, split or file is missing or malformed.

    The message names the path, what is wrong and the expected layout.
    """
