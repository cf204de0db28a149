class PipelineError(Exception):
    """Bad input or a refused operation. `str(err)` is one line naming the file/tensor/key."""

    exit_code = 2


class GateRejected(PipelineError):
    """The bundle was built but the quality gate rejected it."""

    exit_code = 3
