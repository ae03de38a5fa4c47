"""One-line user errors of the `epd` command: what is wrong, how to fix it, and the exit code (2 usage, 1 failure)."""

from __future__ import annotations

USAGE = 2  # the command line is wrong: a bad flag or value (argparse's own code)
FAILURE = 1  # the command line is fine but something failed: unreachable router, a service that did not start


class UserError(Exception):
    """An error the user can fix; `epd` prints `epd: error: <message>` on one line and exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = FAILURE) -> None:
        super().__init__(one_line(message))
        self.exit_code = exit_code

    @property
    def message(self) -> str:
        return str(self)


def usage_error(problem: str, fix: str) -> UserError:
    """A bad value on the command line (exit 2): `problem (fix)`."""
    return UserError(f"{problem} ({fix})", USAGE)


def failure(problem: str, fix: str) -> UserError:
    """Something failed while doing what was asked (exit 1): `problem (fix)`."""
    return UserError(f"{problem} ({fix})", FAILURE)


def one_line(text: str, limit: int = 400) -> str:
    """`text` with its line breaks and runs of spaces collapsed, cut at `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
