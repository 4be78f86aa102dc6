"""The two rich consoles every command prints through (stdout for answers, stderr for progress and errors)."""
from rich.console import Console
from rich.text import Text

console = Console(stderr=False, highlight=False)
err_console = Console(stderr=True, highlight=False)


def print_error(message: str) -> None:
    """'error: MESSAGE' on stderr, the message literal: no markup, no :emoji: codes, no highlighting
    (it may quote a user's file or value)."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", str(message)), soft_wrap=True)


def print_note(label: str, message: str, style: str = "yellow") -> None:
    """'LABEL message' on stdout, the message literal (notes quote paths and trace rows)."""
    console.print(Text.assemble((label, style), " ", str(message)), soft_wrap=True)
