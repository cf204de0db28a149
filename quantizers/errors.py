class QuantizerError(ValueError):
    """A quantizer refused its input; the message is one line naming what and where."""
