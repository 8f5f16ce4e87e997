"""How every experiments/ script starts: user errors print as one line.

`cli.run(main)` replaces `absl.app.run(main)`. A flag absl cannot parse and
any m2jax.errors.UserError (a config value out of range, an unknown preset
or --override field, a --mesh that does not fit, a missing path, a run
directory that cannot be resumed as asked) print one line on stderr,

  error: ModelConfig.num_layers: must be positive (got 0)

and exit with status 2, the usage-error convention. Every other exception
is a bug and keeps its full traceback.

An interrupt is not an error either: a training loop stopped by SIGINT or
SIGTERM (m2jax.train.interrupt.TrainingInterrupted, after checkpointing its
last step) or a Ctrl-C elsewhere prints one line,

  interrupted: SIGINT: stopped after step 120, whose checkpoint is in ...

and exits with the shell's status for the signal (130 SIGINT, 143 SIGTERM).

absl's own app.UsageError is not used: absl answers it with the script's
docstring and a pointer to --helpfull, so the one line that says what was
wrong scrolls away under the usage examples. --help still prints those.
"""

import signal
import sys
from typing import NoReturn

from absl import app, flags

from m2jax.errors import UserError

USAGE_ERROR = 2  # exit status, as for any command-line usage error


def _exit_with(error: Exception) -> NoReturn:
  # Joined onto one line so that a multi-line message still reads as one.
  print("error: " + " ".join(str(error).splitlines()), file=sys.stderr)
  sys.exit(USAGE_ERROR)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # an unparsable value, unknown or missing flag
    _exit_with(e)


def integer_lists(*names: str) -> None:
  """Check at flag parsing that each DEFINE_list flag named holds integers
  (a bad item is then a one-line usage error, not a traceback in main)."""

  def all_integers(items) -> bool:
    try:
      return all(isinstance(int(item), int) for item in items)
    except ValueError:
      return False

  for name in names:
    flags.register_validator(name, all_integers,
                             "must be integers separated by commas")


def run(main) -> None:
  """absl.app.run(main), with user errors reported as one line (exit 2) and
  interrupts as one line (exit 128 + the signal)."""

  def main_reporting_user_errors(argv):
    try:
      return main(argv)
    except UserError as e:
      _exit_with(e)
    except KeyboardInterrupt as e:
      # Exiting: one more Ctrl-C must not turn this line into a traceback.
      for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
      print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
      sys.exit(getattr(e, "exit_status", 128 + signal.SIGINT))

  app.run(main_reporting_user_errors, flags_parser=_parse_flags)
