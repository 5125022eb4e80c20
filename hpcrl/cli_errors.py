"""How the `hpcrl` command ends on an error: one line on stderr and a documented exit code.

    0    done
    1    a run or stage failed, a check found a problem (status --verify, replay), a damaged file in a
         run directory, a full disk
    2    refused input: a bad config, data, model or command line (nothing was started)
    3    an unexpected error: one line here, the traceback in a log file (HPCRL_DEBUG=1 shows it)
    130  interrupted

Every error the user can fix is raised as one of the named exceptions and reported in one line;
anything else is a bug, and its traceback goes to a file rather than the user's terminal.
"""

from __future__ import annotations

import datetime
import errno
import os
import sys
import traceback
from pathlib import Path

import click

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def error_log_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "hpcrl" / "errors"


def write_traceback(err: BaseException) -> Path:
    """The traceback of `err` in a new file under error_log_dir(); its path."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = error_log_dir() / f"{stamp}-{os.getpid()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"hpcrl {' '.join(sys.argv[1:])}\n\n" + "".join(traceback.format_exception(err)))
    return path


class Main(click.Group):
    """The command group: what a command lets escape becomes one line and an exit code."""

    def invoke(self, ctx: click.Context):
        from hpcrl.commit import CorruptOutputError

        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except CorruptOutputError as err:
            fail(str(err), 1)
        except OSError as err:
            if err.errno not in FULL_DISK:
                self._unexpected(err)
            fail(f"{err.filename or 'a file'}: no space left on the disk (or the quota is used up): "
                 f"{err.strerror}; free space there, then run the same command again", 1)
        except Exception as err:  # noqa: BLE001 - the one place that reports what nothing else caught
            self._unexpected(err)

    @staticmethod
    def _unexpected(err: Exception) -> None:
        if os.environ.get("HPCRL_DEBUG"):
            raise err
        try:
            where = f"the traceback is in {write_traceback(err)}"
        except OSError:
            where = "the traceback could not be written; run again with HPCRL_DEBUG=1 to see it"
        fail(f"unexpected {type(err).__name__}: {err} ({where}; please report it)", 3)
