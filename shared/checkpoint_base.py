"""What every checkpoint reader shares (shared.checkpoint, shared.orbax_files), below both of them:
the canonical state's three groups, as the files name them, and the one-line error."""

GROUPS = ("params", "adam_m", "adam_v")  # the canonical state's three dicts, as named in the files


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: one line naming the file and the mismatch."""
