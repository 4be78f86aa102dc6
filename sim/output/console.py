"""The two rich consoles every command prints through (stdout for answers, stderr for progress and errors)."""
import os
import sys

from rich.console import Console
from rich.text import Text

# A pipe or file has no width, and rich's 80 columns would cut a wide table's headers; such
# output gets WIDE_OUTPUT columns unless COLUMNS says otherwise. A terminal keeps its own width.
WIDE_OUTPUT = 200


def _width(stream) -> "int | None":
    if os.environ.get("COLUMNS", "").isdigit():
        return None                               # rich reads COLUMNS itself
    try:
        return None if stream.isatty() else WIDE_OUTPUT
    except (AttributeError, ValueError):          # a closed or replaced stream
        return WIDE_OUTPUT


console = Console(stderr=False, highlight=False, width=_width(sys.stdout))
err_console = Console(stderr=True, highlight=False, width=_width(sys.stderr))


def print_error(message: str) -> None:
    """'error: MESSAGE' on stderr, the message literal: no markup, no :emoji: codes, no highlighting
    (it may quote a user's file or value)."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", str(message)), soft_wrap=True)


def print_note(label: str, message: str, style: str = "yellow") -> None:
    """'LABEL message' on stdout, the message literal (notes quote paths and trace rows)."""
    console.print(Text.assemble((label, style), " ", str(message)), soft_wrap=True)
