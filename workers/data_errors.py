"""The one error of the data layer: the training data cannot be read as the job says."""


class DataError(ValueError):
    """The training data cannot be read as the job says; the message names data.path and the fix."""
