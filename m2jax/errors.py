"""Errors in what the user asked for, as opposed to bugs in m2jax.

Every exception m2jax raises because of its input derives from UserError,
and its message alone (one line) says what was wrong, naming the field, flag
or path. The experiment scripts (experiments/cli.py) print such an error as
that one line and exit with status 2; any other exception is a bug and keeps
its traceback. The user errors are:

  ConfigError        m2jax.config: a config field out of range, an unknown
                     preset or override, a checkpoint made with another
                     config (m2jax.train.checkpoint)
  MeshError          m2jax.sharding: a --mesh that does not parse or fit
  CheckpointError    m2jax.hf: a hub checkpoint m2jax cannot load
  ResumeError        m2jax.train.checkpoint: --resume finds no step to load
  MissingPathError   a path given by the user names nothing usable
  ExistingPathError  a path given by the user already holds what the request
                     would overwrite

Each also derives from the builtin it replaced (ValueError,
FileNotFoundError, FileExistsError), so code catching those still works.
Never catch bare ValueError to find user errors: bugs raise it too.
"""


class UserError(Exception):
  """Bad input: a config value, flag, path or run directory (not a bug)."""


class MissingPathError(UserError, FileNotFoundError):
  """A file or directory the user named does not exist or holds nothing."""


class ExistingPathError(UserError, FileExistsError):
  """A path the user named already holds what the request would replace."""
